"""The command line of scaleout.py (its options and their --quick defaults)."""

from __future__ import annotations

import argparse
from pathlib import Path

from scaleout_procs import DEFAULT_SERVER, HERE


def parse(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="1 and 2 trainers, 1 rep, short windows (a smoke run)")
    parser.add_argument("--trainers", type=int, nargs="+", default=None, help="trainer counts of (a) (default 1 2 4 8)")
    parser.add_argument("--only", choices=["ceiling"], default=None,
                        help="ceiling: (b) and (c) alone, on the ceiling stack and the largest --trainers stack (no (a)); "
                             "writes scaleout-ceiling.json")
    parser.add_argument("--seconds-per-1k-tokens", type=float, default=0.05, help="the fake compute: sleep per 1000 tokens")
    parser.add_argument("--runs-per-trainer", type=int, default=2, help="(a): runs (one tenant each) per trainer")
    parser.add_argument("--fb-datums", type=int, default=4, help="(a): datums per forward_backward")
    parser.add_argument("--fb-tokens", type=int, default=None, help="(a): tokens per datum (default 2048, --quick 512)")
    parser.add_argument("--window", type=int, default=4, help="requests each run keeps in flight in (a) and (b)")
    parser.add_argument("--ceiling-trainers", type=int, default=None, help="(b): instant trainers (default: the largest of --trainers)")
    parser.add_argument("--ceiling-runs", type=int, default=None, help="(b) and (c): runs (default 64, --quick 16)")
    parser.add_argument("--tenants", type=int, default=None, help="tenants per stack, runs given to them in turn (default 16, --quick 4)")
    parser.add_argument("--small-tokens", type=int, default=64, help="(b) and (c): tokens of the one-datum forward_backward")
    parser.add_argument("--latency-fraction", type=float, default=0.5, help="(c): load as a fraction of the (b) ceiling")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of (a) and (b), interleaved (default 3, --quick 1)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds of load before each measured window (default 1.5)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of each measured window (default 6, --quick 1.5)")
    parser.add_argument("--latency-duration", type=float, default=None, help="(c): seconds measured (default 12, --quick 3)")
    parser.add_argument("--database-url", default=None,
                        help=f"PostgreSQL server (any database on it; the role may CREATE DATABASE): each stack gets a fresh "
                             f"database there, dropped at the end (default {DEFAULT_SERVER})")
    parser.add_argument("--durable-floor", action="store_true",
                        help="also drive durable_floor.py: the bare server plus two group-committed Postgres writes per verb")
    parser.add_argument("--sqlite", action="store_true", help="SQLite files in a temporary folder instead of PostgreSQL")
    parser.add_argument("--scheduler-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the schedulers (e.g. TEMPER_SCHEDULER_LOG_LEVEL=WARNING); repeatable")
    parser.add_argument("--replicas", type=int, default=1,
                        help="N > 1: N scheduler replicas on one database against one, side by side, then a replica's SIGKILL "
                             "(scaleout_replicas.py; writes scaleout-replicas.json / .png; not with --only or --sqlite)")
    parser.add_argument("--lease-seconds", type=float, default=2.0, help="--replicas: TEMPER_SCHEDULER_LEASE_SECONDS of every replica")
    parser.add_argument("--failover-timeout", type=float, default=None,
                        help="--replicas: seconds after the kill to wait for every run's next answer (default 10 x lease + 10)")
    parser.add_argument("--failover-retry-delay", type=float, default=0.25,
                        help="--replicas: the clients' resend backoff cap after the kill (the gap measured includes it)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="deadline of one verb")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    args.trainers = sorted(set(args.trainers or ([1, 2] if args.quick else [1, 2, 4, 8])))
    args.fb_tokens = args.fb_tokens or (512 if args.quick else 2048)
    args.ceiling_trainers = args.ceiling_trainers or max(args.trainers)
    args.ceiling_runs = args.ceiling_runs or (16 if args.quick else 64)
    args.tenants = args.tenants or (4 if args.quick else 16)
    args.reps = args.reps or (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.5)
    args.duration = args.duration or (1.5 if args.quick else 6.0)
    args.latency_duration = args.latency_duration or (3.0 if args.quick else 12.0)
    return args, parser
