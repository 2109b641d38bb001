"""Trainer recovery: what adapter snapshots cost, and how long a trainer's death stops its runs.

Real processes (``LocalStack``: scheduler + trainers, no sampler), one client:

  (a) snapshot cost. Two stacks side by side, one with ``recovery=off`` and one with
      ``recovery=snapshot_replay`` (a snapshot every ``--every`` steps); one run on each (same LoRA
      config, seed and data), trained in alternating rounds (forward_backward + optim_step, each
      round waited for), so both see the same machine. ``snapshot_fraction``: the scheduler's
      snapshot wall time (``temper_scheduler_snapshot_seconds_sum``) / the run's training wall time
      on the recovery stack; ``overhead``: mean round time with recovery / without − 1 (includes the
      request log's payload writes; noisier). Goal: snapshot_fraction ≤ 0.05.
  (b) death to training, same address. On the recovery stack, one more round is submitted and the
      trainer SIGKILLed at once and restarted on its port: ``death_to_training_s`` from the kill to
      that round's answers (the new process's start-up ``trainer_restart_s``, the scheduler noticing,
      the restore ``restore_s``: snapshot + replay of the rounds since it, then the round).
  (c) death to training, another trainer (``--no-failover`` skips it). A stack of two trainers; the
      run on the killed one (not restarted) moves to the other after ``dispatch_retry_seconds``
      (``--dispatch-retry``), is restored there and trains: ``failover_s`` from the kill to its answers.

    python benchmarks/recovery.py                      # SmolLM2-135M, rank 16, 4 x 128 tokens, 20 rounds: ~6 min on 2 cores
    python benchmarks/recovery.py --model <tiny folder> --rounds 4 --every 2   # seconds (tests/stack/test_bench_recovery.py)

The last stdout line is the result JSON; also written to benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from harness import add_model_arguments, resolve_model  # this script's folder is first on sys.path

HERE = Path(__file__).resolve().parent
GOAL = 0.05


def metric_sum(service, series: str) -> float:
    """The sum of every sample of ``series`` (any labels) on the service's /metrics."""
    total = 0.0
    with urllib.request.urlopen(service.metrics_url, timeout=10) as page:
        for line in page.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == series:
                total += float(line.rsplit(" ", 1)[1])
    return total


def batch(rng, rows: int, tokens: int, vocab: int):
    from temper.client import Datum, ModelInput

    out = []
    for _ in range(rows):
        seq = rng.integers(0, vocab, tokens + 1)
        out.append(Datum(model_input=ModelInput.from_ints(seq[:-1].tolist()),
                         loss_fn_inputs={"target_tokens": seq[1:].astype(np.int64), "weights": np.ones(tokens, np.float32)}))
    return out


def one_round(tc, data, adam) -> float:
    started = time.perf_counter()
    fb, step = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
    fb.result(timeout=1800)
    step.result(timeout=1800)
    return time.perf_counter() - started


def start(args, work: Path, name: str, databases, env: dict[str, str], trainers: int = 1):
    from temper.localstack import LocalStack

    url, _ = databases.create(name)
    stack = LocalStack(args.model, work / name, database_url=url, num_threads=args.threads, num_trainers=trainers,
                       num_samplers=0, extra_env=env)
    stack.start(timeout=900)
    return stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "torch threads of each trainer")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (forward_backward + optim_step) per stack in (a)")
    parser.add_argument("--every", type=int, default=10, help="snapshot_every_steps of the recovery stack")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dispatch-retry", type=float, default=10.0, help="dispatch_retry_seconds in (c) (the default setting)")
    parser.add_argument("--no-failover", action="store_true", help="skip (c)")
    parser.add_argument("--postgres", default=None, help="PostgreSQL server URL (fresh databases, dropped after); default SQLite")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    resolve_model(args)
    from scaleout_procs import Databases
    from temper.client import AdamParams

    adam = AdamParams(learning_rate=1e-4)
    work = Path(tempfile.mkdtemp(prefix="temper-recovery-"))
    databases = Databases(args.postgres, None if args.postgres else work)
    lora = dict(rank=args.rank, seed=0, train_unembed=False)
    stacks, result = {}, {"benchmark": "recovery"}
    try:
        every = {"TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS": str(args.every)}
        stacks["off"] = start(args, work, "off", databases, {"TEMPER_SCHEDULER_RECOVERY": "off"})
        stacks["on"] = start(args, work, "on", databases, {"TEMPER_SCHEDULER_RECOVERY": "snapshot_replay", **every})
        clients = {k: s.client() for k, s in stacks.items()}
        runs = {k: c.create_lora_training_client(args.model, **lora) for k, c in clients.items()}
        rng = np.random.default_rng(0)
        data = [batch(rng, args.rows, args.tokens, 512) for _ in range(args.rounds + 2)]  # ids < 512: any model here
        for k in ("off", "on"):  # warm-up (first passes allocate), not timed
            one_round(runs[k], data[0], adam)
        scheduler = stacks["on"].service("scheduler")
        before = [metric_sum(scheduler, f"temper_scheduler_snapshot_seconds_{x}") for x in ("sum", "count")]
        times = {"off": [], "on": []}
        for i in range(args.rounds):
            for k in (("off", "on") if i % 2 else ("on", "off")):
                times[k].append(one_round(runs[k], data[1 + i], adam))
        snapshot_s, snapshots = (metric_sum(scheduler, f"temper_scheduler_snapshot_seconds_{x}") - b
                                 for x, b in zip(("sum", "count"), before))
        fraction = snapshot_s / sum(times["on"])
        result["snapshot"] = {
            "snapshot_fraction": fraction, "goal": GOAL, "goal_met": fraction <= GOAL,
            "overhead": statistics.mean(times["on"]) / statistics.mean(times["off"]) - 1,
            "snapshots": int(snapshots), "snapshot_seconds_total": snapshot_s,
            "snapshot_seconds_mean": snapshot_s / snapshots if snapshots else None,
            "round_seconds": {k: {"mean": statistics.mean(v), "median": statistics.median(v), "samples": v} for k, v in times.items()},
        }
        clients["off"].close()
        stacks["off"].stop()

        # (b) the recovery stack's trainer killed with a round in flight, restarted on its port
        killed = time.perf_counter()
        fb, step = runs["on"].forward_backward(data[-1], "cross_entropy"), runs["on"].optim_step(adam)
        stacks["on"].restart("trainer", crash=True, timeout=900)
        restarted = time.perf_counter()
        fb.result(timeout=1800)
        step.result(timeout=1800)
        answered = time.perf_counter()
        result["same_address"] = {
            "death_to_training_s": answered - killed, "trainer_restart_s": restarted - killed,
            "restore_s": metric_sum(scheduler, "temper_scheduler_restore_seconds_sum"),
            "rounds_replayed": (args.rounds + 1) % args.every,
        }
        clients["on"].close()
        stacks["on"].stop()

        if not args.no_failover:  # (c) one of two trainers killed for good
            env = {"TEMPER_SCHEDULER_DISPATCH_RETRY_SECONDS": str(args.dispatch_retry), **every}
            stacks["two"] = start(args, work, "two", databases, env, trainers=2)
            with stacks["two"].client() as client:
                pair = [client.create_lora_training_client(args.model, **lora) for _ in range(2)]  # one per trainer (by load)
                for i in range(3):
                    for tc in pair:
                        one_round(tc, data[1 + i], adam)
                victim = stacks["two"].service("trainer-1")
                victim.process.kill()
                killed = time.perf_counter()
                for tc in pair:
                    one_round(tc, data[-1], adam)
                result["other_trainer"] = {
                    "failover_s": time.perf_counter() - killed, "dispatch_retry_seconds": args.dispatch_retry,
                    "restore_s": metric_sum(stacks["two"].service("scheduler"), "temper_scheduler_restore_seconds_sum"),
                }
        result["config"] = {"model": str(args.model), "threads": args.threads, "rounds": args.rounds, "every": args.every,
                            "rows": args.rows, "tokens": args.tokens, "rank": args.rank,
                            "database": "postgres" if args.postgres else "sqlite",
                            "load_average_at_end": os.getloadavg()[0]}
    finally:
        for stack in stacks.values():
            stack.stop()
        databases.drop_all()
        shutil.rmtree(work, ignore_errors=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "recovery.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
