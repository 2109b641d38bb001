"""Scale-out benchmark: the scheduler itself, with fake trainers whose compute is a sleep.

Each stack is a real scheduler process (``python -m temper.scheduler``, its own fresh database) in
front of N fake trainers and one fake sampler (``fake_workers.py``, one process per stack: the real
worker gRPC contract behind the internal token, a sleep of ``--seconds-per-1k-tokens`` per 1000
forward/backward tokens of a cycle instead of a model). This process is the clients: raw gRPC calls
to the public API (``temper.v1.TemperStub``, an API key per tenant), no client library in the way.
It measures, side by side in one run (repetitions interleaved in a rotating order, medians):

  (a) throughput    training tokens/s with 1, 2, 4, 8 fake trainers, relative to 1 trainer. Every
                    trainer has --runs-per-trainer runs (a tenant each), and every run keeps --window
                    requests in flight (forward_backward of --fb-datums x --fb-tokens tokens, then
                    optim_step, ...), so no lane ever waits for a client.            goal >= 0.9 x N
  (b) ceiling       verbs/s (forward_backward + optim_step answered) with instant workers (sleep 0),
                    --ceiling-trainers trainers, --ceiling-runs runs over --tenants tenants, each with
                    --window small requests in flight (1 datum x --small-tokens tokens).
                    Side by side, the same clients drive --grpc-floor (``grpc_floor.py``): the public
                    service answered at once by a bare grpc.aio server (no auth, admission, database or
                    trainer); the ceiling is also read as a fraction of that transport floor. With
                    --durable-floor, also ``durable_floor.py``: that server plus two group-committed
                    Postgres writes per verb, an upper bound for a scheduler of this design.
  (c) latency       open-loop (Poisson) arrivals at --latency-fraction x the (b) median, the same small
                    requests on the largest (a) stack (workers sleeping): p50/p99 per verb of what the
                    scheduler adds, latency minus the time the fake worker spent on the verb's cycle.

Throughput is counted from the workers' own cycle boundaries (the fake trainer stamps each answer with
its cycle's number, start and end on CLOCK_MONOTONIC): per trainer, tokens of the cycles that ended
in the measured window after its first one / the time between its first and last cycle end, summed.
CPU seconds of the scheduler, the fake workers, this client process and (Postgres) the scheduler's
database backends are recorded for every measurement, with the machine's busy fraction.

    python benchmarks/scaleout.py            # about 3.5 minutes on 2 CPU cores
    python benchmarks/scaleout.py --quick    # 1 and 2 trainers, 1 rep, short windows: about 30 seconds
    python benchmarks/scaleout.py --only ceiling   # (b) and (c) alone: about 1 minute
    python benchmarks/scaleout.py --replicas 2     # 2 scheduler replicas against 1 (scaleout_replicas.py): ~2.5 minutes
    python benchmarks/scaleout.py --replicas 2 --quick   # the same, 1 rep, short windows: under a minute

The pieces: scaleout_procs.py (processes, databases, stacks, CPU use), scaleout_load.py (the clients, the load
and what the answers say), scaleout_runs.py (the tenant and run records both of those use), scaleout_replicas.py
(--replicas: its stacks, failover and summary), grpc_floor.py (the bare gRPC server), durable_floor.py (it, writing
each verb twice).

The last stdout line is the result JSON; it is also written to benchmarks/results/scaleout.json, with
a plot in benchmarks/results/scaleout.png.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from scaleout_load import (FB, OPT, Clients, closed_loop, connect, create_runs, latency_summary, make_data, median,
                           open_loop, summarize_ceiling, tokens_per_second, verbs_per_second)
from scaleout_args import parse as parse_args
from scaleout_procs import DEFAULT_SERVER, REPO, Databases, Stack, Usage, start_all

SMALL = ("ceiling", "floor", "durable_floor")  # the variants driven with the small verbs
GOAL_FRACTION = 0.9


def source_digests() -> dict:
    """Which scheduler was measured: short sha256 of its loop's files (they change often) and git's view."""
    out = {}
    for rel in ("scheduler/planning/loop.py", "scheduler/planning/lanes.py", "scheduler/workers/backends.py", "scheduler/planning/policy.py", "scheduler/planning/admission.py"):
        path = REPO / rel
        if path.exists():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    try:
        out["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), dpi=90)
    t = result["throughput"]
    ns = t["trainers"]
    ratios = [t["ratios"][str(n)] if t["ratios"][str(n)] is not None else float("nan") for n in ns]
    ax = axes[0]
    ax.plot(ns, ns, "--", color="grey", label="ideal (N)")
    ax.plot(ns, [GOAL_FRACTION * n for n in ns], ":", color="black", label=f"goal {GOAL_FRACTION} x N")
    ax.plot(ns, ratios, "o-", color="#2f6db5", label="measured")
    for n, r in zip(ns, ratios):
        ax.annotate(f"{r:.2f}", (n, r), textcoords="offset points", xytext=(-8, 6), fontsize=8)
    ax.set_xlabel("fake trainers")
    ax.set_ylabel("tokens/s relative to 1 trainer")
    ax.set_title(f"(a) throughput ({t['tokens_per_s'][str(ns[0])]:.0f} tok/s at 1)", fontsize=9)
    ax.set_xticks(ns)
    ax.legend(fontsize=7)

    c = result["ceiling"]
    ax = axes[1]
    bars = [(c["verbs_per_s"], c["samples_verbs_per_s"], "#3a923a"),
            (c["grpc_floor_verbs_per_s"], c["grpc_floor_samples_verbs_per_s"], "#999999")]
    for x, (value, reps, color) in enumerate(bars):
        ax.bar([x], [value], color=color, width=0.6)
        ax.plot([x] * len(reps), reps, "k.", markersize=6, label="repetitions" if x == 0 else None)
        ax.text(x, value, f"{value:.0f}", ha="center", va="bottom", fontsize=9, fontweight="bold")
    cores = c["cores"].get("scheduler")
    ax.set_xticks([0, 1], [f"scheduler: {c['trainers']} trainers,\n{c['runs']} runs x {c['window_per_run']} in flight",
                           f"bare gRPC server\n(ceiling / it: {c['fraction_of_grpc_floor']:.2f})"], fontsize=8)
    ax.set_xlim(-0.7, 1.7)
    ax.set_ylim(0, max(c["samples_verbs_per_s"] + c["grpc_floor_samples_verbs_per_s"] + [1.0]) * 1.2)
    ax.set_ylabel("verbs/s answered")
    ax.set_title("(b) ceiling, instant workers" + (f" (scheduler {cores:.2f} cores)" if cores is not None else ""), fontsize=9)
    ax.legend(fontsize=7)

    lat = result["latency"]["per_verb"]
    ax = axes[2]
    verbs = [FB, OPT, "all"]
    for j, (stat, color) in enumerate((("p50", "#2f6db5"), ("p99", "#c8423a"))):
        values = [lat[v]["added_ms"][stat] or 0 for v in verbs]
        bars = ax.bar(np.arange(3) + (j - 0.5) * 0.38, values, width=0.36, color=color, label=stat)
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(3), ["fwd_bwd", "optim", "all"], fontsize=8)
    ax.set_ylabel("ms added by the scheduler")
    ax.set_title(f"(c) latency - worker time, {result['latency']['achieved_verbs_per_s']:.0f} verbs/s "
                 f"(target {result['latency']['target_verbs_per_s']:.0f})", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"Temper scheduler scale-out (fake workers, {result['config']['seconds_per_1k_tokens']} s / 1k tokens, "
                 f"repetitions: {result['config']['reps']}, {os.cpu_count()} CPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------------


async def measure(args, stacks: dict, databases: Databases, progress) -> dict:
    from tqdm import tqdm

    rng = np.random.default_rng(args.seed)
    clients = Clients(args.request_timeout)
    big = make_data(args.fb_datums, args.fb_tokens, rng)
    small = make_data(1, args.small_tokens, rng)
    for stack in stacks.values():
        await connect(stack)
    throughput_ns = [] if args.only == "ceiling" else args.trainers
    for n in throughput_ns:
        await create_runs(stacks[f"n{n}"], "throughput", n * args.runs_per_trainer, big)
    await create_runs(stacks["ceiling"], "small", args.ceiling_runs, small)
    for floor in ("floor", "durable_floor"):
        if floor in stacks:
            await create_runs(stacks[floor], "small", args.ceiling_runs, small)
    await create_runs(stacks[f"n{max(args.trainers)}"], "small", args.ceiling_runs, small)
    progress.update()

    variants = [f"n{n}" for n in throughput_ns] + ["ceiling", "floor"] + (["durable_floor"] if "durable_floor" in stacks else [])
    samples: dict[str, list[dict]] = {v: [] for v in variants}
    progress.set_postfix_str("warm-up")
    for v in variants:  # one short pass each: channels, caches, the first cycles
        workload = "small" if v in SMALL else "throughput"
        await closed_loop(clients, stacks[v].runs[workload], args.window, 0.0, args.warmup, Usage(stacks[v], databases))
    progress.update()
    for rep in range(args.reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            progress.set_postfix_str(f"rep {rep + 1}/{args.reps}: {v}")
            stack = stacks[v]
            workload = "small" if v in SMALL else "throughput"
            got = await closed_loop(clients, stack.runs[workload], args.window, args.warmup, args.duration, Usage(stack, databases))
            if v in SMALL:
                sample = {"verbs_per_s": verbs_per_second(got["done"], got["window"])}
            else:
                sample = tokens_per_second(got["done"], got["window"], stack.trainers)
                sample["verbs_per_s"] = verbs_per_second(got["done"], got["window"])
            sample["usage"] = got["usage"]
            samples[v].append(sample)
            progress.update()
        tqdm.write(f"rep {rep + 1}: " + ", ".join(
            f"{v} {samples[v][-1]['verbs_per_s']:.0f} verbs/s" if v in SMALL else f"{v} {samples[v][-1]['tokens_per_s']:.0f} tok/s"
            for v in variants), file=sys.stderr)

    ceiling = median([s["verbs_per_s"] for s in samples["ceiling"]])
    target = args.latency_fraction * (ceiling or 0.0)
    progress.set_postfix_str(f"latency at {target:.0f} verbs/s")
    latency_stack = stacks[f"n{max(args.trainers)}"]
    got = await open_loop(clients, latency_stack.runs["small"], max(target, 0.5), args.warmup, args.latency_duration,
                          Usage(latency_stack, databases), args.seed)
    progress.update()
    latency = {"target_verbs_per_s": target, "achieved_verbs_per_s": verbs_per_second(got["done"], got["window"]),
               "sent": got["sent"], "per_verb": latency_summary(got["done"], got["window"]), "usage": got["usage"],
               "stack": latency_stack.name, "trainers": latency_stack.trainers, "runs": args.ceiling_runs}
    for stack in stacks.values():
        for tenant in stack.tenants:
            await tenant.channel.close()
    return {"samples": samples, "latency": latency, "clients": clients}


def summarize(args, samples: dict, latency: dict, clients: Clients, stacks: dict) -> dict:
    if args.only == "ceiling":
        return {"benchmark": "scaleout", "throughput": None, "ceiling": summarize_ceiling(args, samples),
                "latency": latency, "retries": dict(clients.retries), "errors": {"count": clients.error_count, "first": clients.errors}}
    ideal = 1000.0 / args.seconds_per_1k_tokens if args.seconds_per_1k_tokens > 0 else None
    tps = {str(n): median([s["tokens_per_s"] for s in samples[f"n{n}"]]) for n in args.trainers}
    first = args.trainers[0]  # 1 by default; a larger smallest count is scaled to "per 1 trainer"
    base = tps[str(first)]
    ratios = {str(n): tps[str(n)] / base * first if base else None for n in args.trainers}
    # each rep's own ratio too (rep i of N against rep i of the smallest count): noise shows as their spread
    per_rep = {str(n): [s["tokens_per_s"] / b["tokens_per_s"] * first if b["tokens_per_s"] else None
                        for s, b in zip(samples[f"n{n}"], samples[f"n{first}"])] for n in args.trainers}

    def usage_median(variant: str, key: str):
        return median([s["usage"]["cores"].get(key) for s in samples[variant]])

    throughput = {
        "trainers": args.trainers,
        "ratios": ratios,
        "ratio_over_n": {k: (v / int(k) if v is not None else None) for k, v in ratios.items()},
        "goal": f">= {GOAL_FRACTION} x N",
        "goal_met": {k: (v >= GOAL_FRACTION * int(k) if v is not None else None) for k, v in ratios.items()},
        "tokens_per_s": tps,
        "efficiency": {str(n): (tps[str(n)] / (n * ideal) if ideal else None) for n in args.trainers},
        "ideal_tokens_per_s_per_trainer": ideal,
        "samples_tokens_per_s": {str(n): [s["tokens_per_s"] for s in samples[f"n{n}"]] for n in args.trainers},
        "samples_ratio": per_rep,
        "answered_tokens_per_s": {str(n): median([s["answered_tokens_per_s"] for s in samples[f"n{n}"]]) for n in args.trainers},
        "trainer_busy_fraction": {str(n): median([s["trainer_busy_fraction"] for s in samples[f"n{n}"]]) for n in args.trainers},
        "per_trainer_tokens_per_s": {str(n): samples[f"n{n}"][-1]["per_trainer_tokens_per_s"] for n in args.trainers},
        "verbs_per_s": {str(n): median([s["verbs_per_s"] for s in samples[f"n{n}"]]) for n in args.trainers},
        "scheduler_cores": {str(n): usage_median(f"n{n}", "scheduler") for n in args.trainers},
        "scheduler_cycles_per_s": {str(n): median([(s["usage"]["scheduler_cycles"] or 0) / args.duration for s in samples[f"n{n}"]])
                                   for n in args.trainers},
        "runs_per_trainer_seen": {str(n): dict(sorted(Counter(t for r in stacks[f"n{n}"].runs["throughput"] for t in r.trainers).items()))
                                  for n in args.trainers},
    }
    ceiling = summarize_ceiling(args, samples)
    throughput["verbs_fraction_of_ceiling"] = {k: (v / ceiling["verbs_per_s"] if v is not None and ceiling["verbs_per_s"] else None)
                                               for k, v in throughput["verbs_per_s"].items()}
    return {
        "benchmark": "scaleout",
        "throughput": throughput,
        "ceiling": ceiling,
        "latency": latency,
        "retries": dict(clients.retries),
        "errors": {"count": clients.error_count, "first": clients.errors},
        "measures": {
            "throughput": f"training tokens/s with N fake trainers ({args.runs_per_trainer} runs each, {args.window} requests "
                          f"in flight per run, forward_backward of {args.fb_datums} x {args.fb_tokens} tokens then optim_step), "
                          f"counted from the workers' cycle ends; ratios: median over reps / median at {args.trainers[0]} trainer(s)",
            "ceiling": f"forward_backward + optim_step answered per second, instant workers, {args.ceiling_runs} runs "
                       f"x {args.window} in flight, forward_backward of 1 x {args.small_tokens} tokens",
            "latency": f"Poisson arrivals at {args.latency_fraction} x the ceiling on the {max(args.trainers)}-trainer stack "
                       f"(workers sleeping): latency - the fake worker's time on the verb's cycle",
        },
    }


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv, __doc__.splitlines()[0])
    scheduler_env = dict(item.split("=", 1) for item in args.scheduler_env)
    if args.replicas > 1:
        if args.only or args.sqlite:
            parser.error("--replicas runs its own stacks on PostgreSQL: not with --only or --sqlite")
        args.failover_timeout = args.failover_timeout or 10 * args.lease_seconds + 10
        import scaleout_replicas

        result = scaleout_replicas.run(args, scheduler_env, {
            "scheduler_sources": source_digests(), "python": platform.python_version(), "grpc": grpc.__version__,
            "cpu_count": os.cpu_count()})
        print(json.dumps(result))
        return 0

    from tqdm import tqdm

    started = time.perf_counter()
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="temper-scaleout-"))
    log_dir = work / "logs"
    log_dir.mkdir()
    databases = Databases(None if args.sqlite else (args.database_url or DEFAULT_SERVER), work if args.sqlite else None)
    stacked = [max(args.trainers)] if args.only == "ceiling" else args.trainers  # the largest one is (c)'s
    stacks = {f"n{n}": Stack(f"n{n}", n, args.seconds_per_1k_tokens) for n in stacked}
    stacks["ceiling"] = Stack("ceiling", args.ceiling_trainers, 0.0)
    floors = [Stack("floor", 0, 0.0)] + ([Stack("durable_floor", 0, 0.0)] if args.durable_floor else [])
    variants = (2 if args.only == "ceiling" else len(args.trainers) + 2) + (1 if args.durable_floor else 0)
    progress = tqdm(total=len(stacks) * 2 + 2 + args.reps * variants + 1, desc="scaleout", unit="step", file=sys.stderr)
    token = secrets.token_urlsafe(32)
    failed, kept_logs = True, None
    try:
        start_all(stacks, floors, databases, log_dir, token, scheduler_env, args.tenants, progress)
        progress.set_postfix_str("sessions and runs")
        measured = asyncio.run(measure(args, stacks, databases, progress))
        failed = measured["clients"].error_count > 0  # the schedulers' logs say why: kept
    finally:
        progress.close()
        for stack in stacks.values():
            for proc in (*stack.schedulers, stack.workers):
                if proc is not None:
                    proc.stop()
        databases.drop_all()
        if failed or args.keep_logs:
            kept_logs = str(log_dir)
            print(f"logs of the schedulers and fake workers: {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    result = summarize(args, measured["samples"], measured["latency"], measured["clients"], stacks)
    result["config"] = {
        "trainers": args.trainers, "seconds_per_1k_tokens": args.seconds_per_1k_tokens, "runs_per_trainer": args.runs_per_trainer,
        "fb_datums": args.fb_datums, "fb_tokens": args.fb_tokens, "window": args.window, "ceiling_trainers": args.ceiling_trainers,
        "ceiling_runs": args.ceiling_runs, "tenants": args.tenants, "small_tokens": args.small_tokens,
        "latency_fraction": args.latency_fraction, "reps": args.reps, "warmup_s": args.warmup, "duration_s": args.duration,
        "latency_duration_s": args.latency_duration, "quick": args.quick, "only": args.only,
        "database": "sqlite" if args.sqlite else "postgresql", "scheduler_env": scheduler_env,
        "samplers_per_stack": 1, "scheduler_sources": source_digests(), "python": platform.python_version(),
        "grpc": grpc.__version__, "cpu_count": os.cpu_count(), "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
    }
    result["logs"] = kept_logs
    result["total_seconds"] = time.perf_counter() - started
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.only == "ceiling":
        (args.out_dir / "scaleout-ceiling.json").write_text(json.dumps(result, indent=2) + "\n")
    else:
        (args.out_dir / "scaleout.json").write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.out_dir / "scaleout.png")
    t = result["throughput"]
    for n in ([] if t is None else args.trainers):
        r = t["ratios"][str(n)] or 0.0
        print(f"throughput x{n:<2d} {t['tokens_per_s'][str(n)]:9.0f} tok/s  ratio {r:5.2f}  (goal >= {GOAL_FRACTION * n:.1f}: "
              f"{'met' if t['goal_met'][str(n)] else 'MISSED'}; trainers busy {t['trainer_busy_fraction'][str(n)]:.2f})",
              file=sys.stderr)
    c = result["ceiling"]
    print(f"ceiling {c['verbs_per_s']:.0f} verbs/s (scheduler {c['cores']['scheduler'] or 0:.2f} cores, machine busy "
          f"{c['machine_busy_fraction'] or 0:.2f}); bare gRPC server {c['grpc_floor_verbs_per_s']:.0f} verbs/s: "
          f"ceiling / floor {c['fraction_of_grpc_floor'] or 0:.2f}", file=sys.stderr)
    if "durable_floor_verbs_per_s" in c:
        print(f"durable floor {c['durable_floor_verbs_per_s']:.0f} verbs/s ({c['durable_floor_verbs_per_s'] / c['grpc_floor_verbs_per_s']:.2f} "
              f"of the bare server); ceiling / it {c['ceiling_fraction_of_durable_floor'] or 0:.2f}", file=sys.stderr)
    for verb, stats in result["latency"]["per_verb"].items():
        a = stats["added_ms"]
        if a["n"]:
            print(f"added latency {verb:16s} p50 {a['p50']:7.1f} ms  p99 {a['p99']:7.1f} ms  (n={a['n']})", file=sys.stderr)
    if result["errors"]["count"]:
        print(f"{result['errors']['count']} verbs failed, e.g. {result['errors']['first'][:3]}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
