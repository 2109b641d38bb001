"""``scaleout.py --replicas N``: N scheduler replicas on one PostgreSQL database against one, side by side.

Stacks, all with instant fake trainers (sleep 0) and the (b) ceiling's small verbs:

  ceiling      one scheduler process, TEMPER_SCHEDULER_REPLICAS=true (a cluster of one, same lease)
  replicas     N such processes on one database, the same trainer and sampler lists (as LocalStack's
               num_schedulers); every tenant's channel is the N addresses as one list with round_robin
  direct       the replicas stack again, each run's calls sent straight to the replica owning its lane
               (nothing forwarded): splits what N replicas cost into the split itself and the forwarding
  hinted       the replicas stack again, round_robin channels, each run's calls sent where its last answer's
               owner hint (temper-lane-owner, common/owner_hints.py) points, as temper.client does
  floor, durable_floor   the bare gRPC server and durable_floor.py, as in (b)

Repetitions interleave the four (closed loop, --window in flight per run). Then the failover: under the
same load on the replicas stack, the replica that owns run 0's lane is SIGKILLed; per run of every lane
it owned, the time from the kill to the first answer of an attempt sent after it (resends back off at
most --failover-retry-delay). What it reports is in ``summarize``; the plot is results/scaleout-replicas.png.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from scaleout_load import Clients, closed_loop, connect, create_runs, make_data, median, summarize_ceiling, verbs_per_second
from scaleout_procs import Databases, Stack, Usage
from scaleout_replica_stacks import guarded, lane_owners, run_lanes, wait_balanced
from scaleout_replicas_report import CPU_GOAL, FLOOR_GOAL, plot, report
from temper.common.server_options import CHANNEL_OPTIONS
from temper.v1 import service_pb2_grpc

VARIANTS = ("ceiling", "replicas", "direct", "hinted", "floor", "durable_floor")
FAILOVER_GOAL_LEASES = 2.0

async def failover(args, clients: Clients, stack: Stack, deliberate: set[int]) -> dict:
    """SIGKILL the replica that owns run 0's lane under load; per run on its lanes, kill -> next answer."""
    runs = stack.runs["small"]
    done: list = []
    stop = asyncio.Event()

    async def drive(run) -> None:
        slots, flying = asyncio.Semaphore(args.window), set()
        while True:
            await slots.acquire()
            if stop.is_set():
                break
            task = asyncio.create_task(clients.send(run, run.take_seq(), done))
            flying.add(task)
            task.add_done_callback(lambda t: (flying.discard(t), slots.release()))
        await asyncio.gather(*flying)

    errors_before = clients.error_count
    drivers = [asyncio.create_task(drive(run)) for run in runs]
    await asyncio.sleep(args.warmup)
    owners, placed = await asyncio.to_thread(lane_owners, stack), await asyncio.to_thread(run_lanes, stack)
    victim_address = owners[placed[runs[0].id]]
    victim = next(p for p in stack.schedulers if f"127.0.0.1:{p.ready['port']}" == victim_address)
    lanes = sorted(lane for lane, owner in owners.items() if owner == victim_address)
    mine = [r for r in runs if placed.get(r.id) in lanes]
    deliberate.add(victim.process.pid)
    killed_at = time.monotonic()
    victim.process.send_signal(signal.SIGKILL)
    lanes_taken_s = None
    deadline = killed_at + args.failover_timeout
    while time.monotonic() < deadline:
        if lanes_taken_s is None:
            now_owners = await asyncio.to_thread(lane_owners, stack)
            if all(now_owners.get(lane) not in (None, victim_address) for lane in lanes):
                lanes_taken_s = time.monotonic() - killed_at
        answered = {d.run.id for d in done if d.last_try >= killed_at}
        if lanes_taken_s is not None and all(r.id in answered for r in mine):
            break
        await asyncio.sleep(0.05)
    stop.set()
    try:
        await asyncio.wait_for(asyncio.gather(*drivers), timeout=60)
    except asyncio.TimeoutError:
        for task in drivers:
            task.cancel()
    gaps = {}
    for run in mine:
        after = [d.answered for d in done if d.run is run and d.last_try >= killed_at]
        gaps[run.id] = (min(after) - killed_at) if after else None
    known = [g for g in gaps.values() if g is not None]
    goal = FAILOVER_GOAL_LEASES * args.lease_seconds
    return {
        "killed": victim.name, "killed_address": victim_address, "lanes": lanes, "runs": len(mine),
        "lease_seconds": args.lease_seconds, "goal_s": goal, "retry_delay_cap_s": clients.max_retry_delay,
        "next_answer_s": {"median": median(known), "p90": float(np.percentile(known, 90)) if known else None,
                          "max": max(known) if known else None, "per_run": gaps},
        "unanswered_runs": sum(1 for g in gaps.values() if g is None),
        "lanes_taken_s": lanes_taken_s,
        "goal_met": bool(known) and len(known) == len(gaps) and max(known) <= goal,
        "errors": clients.error_count - errors_before,
    }


async def measure(args, stacks: dict, databases: Databases, progress, deliberate: set[int]) -> dict:
    from tqdm import tqdm

    clients = Clients(args.request_timeout)
    small = make_data(1, args.small_tokens, np.random.default_rng(args.seed))
    for stack in stacks.values():
        await connect(stack)
    progress.set_postfix_str("lanes over the replicas")
    held = await wait_balanced(stacks["replicas"], args.ceiling_trainers)
    for name in VARIANTS:
        if name not in ("direct", "hinted"):
            await create_runs(stacks[name], "small", args.ceiling_runs, small)
    placed = await asyncio.to_thread(run_lanes, stacks["replicas"])
    owners = await asyncio.to_thread(lane_owners, stacks["replicas"])
    runs_per_replica = {a: sum(1 for lane in placed.values() if owners.get(lane) == a) for a in held}
    # "direct": the replicas stack's runs again, each through a channel to its lane's owner
    channels = {a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in held}
    direct_stubs = {r.id: service_pb2_grpc.TemperStub(channels[owners[placed[r.id]]]) for r in stacks["replicas"].runs["small"]}
    stacks["direct"] = stacks["hinted"] = stacks["replicas"]
    progress.update()
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    progress.set_postfix_str("warm-up")
    def route(v: str) -> None:
        clients.hinted = v == "hinted"
        for run in stacks["replicas"].runs["small"]:
            run.stub = direct_stubs[run.id] if v == "direct" else None

    for v in VARIANTS:
        route(v)
        await closed_loop(clients, stacks[v].runs["small"], args.window, 0.0, args.warmup, Usage(stacks[v], databases))
    progress.update()
    for rep in range(args.reps):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
        for v in order:
            progress.set_postfix_str(f"rep {rep + 1}/{args.reps}: {v}")
            route(v)
            got = await closed_loop(clients, stacks[v].runs["small"], args.window, args.warmup, args.duration,
                                    Usage(stacks[v], databases))
            samples[v].append({"verbs_per_s": verbs_per_second(got["done"], got["window"]), "usage": got["usage"],
                               "answered": sum(1 for d in got["done"] if got["window"][0] <= d.answered <= got["window"][1])})
            progress.update()
        tqdm.write(f"rep {rep + 1}: " + ", ".join(f"{v} {samples[v][-1]['verbs_per_s']:.0f} verbs/s" for v in VARIANTS), file=sys.stderr)
    route("replicas")
    progress.set_postfix_str("failover: SIGKILL of a lane's replica")
    clients.max_retry_delay = args.failover_retry_delay
    killed = await failover(args, clients, stacks["replicas"], deliberate)
    clients.max_retry_delay = 1.0
    progress.update()
    for channel in channels.values():
        await channel.close()
    await clients.close()
    for name, stack in stacks.items():
        for tenant in ([] if name in ("direct", "hinted") else stack.tenants):
            await tenant.channel.close()
    return {"samples": samples, "failover": killed, "clients": clients, "lanes": held, "runs_per_replica": runs_per_replica}


def _per_verb_ms(sample: dict, key: str) -> float | None:
    cores, rate = sample["usage"]["cores"].get(key), sample["verbs_per_s"]
    return cores / rate * 1000.0 if cores is not None and rate else None


def _side(samples: list[dict], keys: tuple[str, ...]) -> dict:
    """One stack's medians: verbs/s, cores by process group, CPU ms per verb of the scheduler(s) and Postgres."""
    return {
        "verbs_per_s": median([s["verbs_per_s"] for s in samples]),
        "samples_verbs_per_s": [s["verbs_per_s"] for s in samples],
        "cores": {k: median([s["usage"]["cores"].get(k) for s in samples]) for k in keys},
        "machine_busy_fraction": median([s["usage"]["machine_busy_fraction"] for s in samples]),
        "scheduler_cpu_ms_per_verb": median([_per_verb_ms(s, "scheduler") for s in samples]),
        "database_cpu_ms_per_verb": median([_per_verb_ms(s, "database") for s in samples]),
        "client_cpu_ms_per_verb": median([_per_verb_ms(s, "client") for s in samples]),
        "samples_scheduler_cpu_ms_per_verb": [_per_verb_ms(s, "scheduler") for s in samples],
    }


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(args, measured: dict) -> dict:
    samples, n = measured["samples"], args.replicas
    groups = ("scheduler", "database", "client", "workers")
    one = _side(samples["ceiling"], groups)
    many = _side(samples["replicas"], groups + tuple(f"scheduler-{i}" for i in range(n)))
    forwarded = [s["usage"]["forwarded"] / s["answered"] for s in samples["replicas"]
                 if s["usage"]["forwarded"] is not None and s["answered"]]
    many["forwarded_fraction"] = median(forwarded)
    many["samples_forwarded_fraction"] = forwarded
    many["expected_forwarded_fraction"] = (n - 1) / n
    many["lanes_per_replica"] = {a: len(v) for a, v in measured["lanes"].items()}
    many["runs_per_replica"] = measured["runs_per_replica"]
    direct = _side(samples["direct"], groups + tuple(f"scheduler-{i}" for i in range(n)))
    direct["forwarded_fraction"] = median([s["usage"]["forwarded"] / s["answered"] for s in samples["direct"]
                                           if s["usage"]["forwarded"] is not None and s["answered"]])
    hinted = _side(samples["hinted"], groups + tuple(f"scheduler-{i}" for i in range(n)))
    hinted["forwarded_fraction"] = median([s["usage"]["forwarded"] / s["answered"] for s in samples["hinted"]
                                           if s["usage"]["forwarded"] is not None and s["answered"]])
    ceiling = summarize_ceiling(args, samples)
    durable = samples["durable_floor"]
    durable_ms = median([_per_verb_ms(s, "scheduler") for s in durable])
    bare_ms = median([_per_verb_ms(s, "scheduler") for s in samples["floor"]])
    extra = (many["scheduler_cpu_ms_per_verb"] - direct["scheduler_cpu_ms_per_verb"]
             if many["scheduler_cpu_ms_per_verb"] is not None and direct["scheduler_cpu_ms_per_verb"] is not None else None)
    # each rep's own ratio too (rep i of the replicas against rep i of the one): noise shows as their spread
    per_rep = [_ratio(_per_verb_ms(a, "scheduler"), _per_verb_ms(b, "scheduler")) for a, b in zip(samples["replicas"], samples["ceiling"])]
    ratios = {
        "scheduler_cpu_per_verb": _ratio(many["scheduler_cpu_ms_per_verb"], one["scheduler_cpu_ms_per_verb"]),
        "samples_scheduler_cpu_per_verb": per_rep,
        "verbs_per_s": _ratio(many["verbs_per_s"], one["verbs_per_s"]),
        # the split alone: N replicas, each verb sent to its lane's owner (nothing forwarded), over one
        "direct_scheduler_cpu_per_verb": _ratio(direct["scheduler_cpu_ms_per_verb"], one["scheduler_cpu_ms_per_verb"]),
        "direct_verbs_per_s": _ratio(direct["verbs_per_s"], one["verbs_per_s"]),
        # round_robin clients that follow the owner hints (what temper.client and the gateway do)
        "hinted_scheduler_cpu_per_verb": _ratio(hinted["scheduler_cpu_ms_per_verb"], one["scheduler_cpu_ms_per_verb"]),
        "samples_hinted_scheduler_cpu_per_verb": [_ratio(_per_verb_ms(a, "scheduler"), _per_verb_ms(b, "scheduler"))
                                                  for a, b in zip(samples["hinted"], samples["ceiling"])],
        "hinted_verbs_per_s": _ratio(hinted["verbs_per_s"], one["verbs_per_s"]),
        "database_cpu_per_verb": _ratio(many["database_cpu_ms_per_verb"], one["database_cpu_ms_per_verb"]),
        "one_scheduler_cpu_per_verb_over_durable_floor": _ratio(one["scheduler_cpu_ms_per_verb"], durable_ms),
        # what round_robin's replicas spend above the direct ones, per verb they forwarded (a forwarded verb passes
        # two gRPC servers and one client call): compare with the bare server's CPU per verb
        "extra_scheduler_cpu_ms_per_forwarded_verb": _ratio(extra, many["forwarded_fraction"]),
    }
    f = measured["failover"]
    return {
        "benchmark": "scaleout-replicas",
        "replicas": n,
        "one": one,
        "many": many,
        "direct": direct,
        "hinted": hinted,
        "ratios": ratios,
        "failover": f,
        "durable_floor_cpu_ms_per_verb": durable_ms,
        "grpc_floor_cpu_ms_per_verb": bare_ms,
        "goals": {
            "scheduler_cpu_per_verb": {"goal": f"<= {CPU_GOAL}", "met": ratios["scheduler_cpu_per_verb"] is not None
                                       and ratios["scheduler_cpu_per_verb"] <= CPU_GOAL},
            "hinted_scheduler_cpu_per_verb": {"goal": f"<= {CPU_GOAL}", "met": ratios["hinted_scheduler_cpu_per_verb"] is not None
                                              and ratios["hinted_scheduler_cpu_per_verb"] <= CPU_GOAL},
            "failover_s": {"goal": f"<= {FAILOVER_GOAL_LEASES} x lease = {f['goal_s']:.1f} s", "met": f["goal_met"]},
            "one_over_durable_floor": {"goal": f"<= {FLOOR_GOAL}", "met": ratios["one_scheduler_cpu_per_verb_over_durable_floor"]
                                       is not None and ratios["one_scheduler_cpu_per_verb_over_durable_floor"] <= FLOOR_GOAL},
        },
        "ceiling": ceiling,
        "retries": dict(measured["clients"].retries),
        "errors": {"count": measured["clients"].error_count, "first": measured["clients"].errors},
        "measures": {
            "one / many": f"forward_backward + optim_step answered per second, instant workers ({args.ceiling_trainers} fake trainers), "
                          f"{args.ceiling_runs} runs over {args.tenants} tenants x {args.window} in flight, 1 x {args.small_tokens} "
                          f"tokens per forward_backward; one scheduler (a cluster of one) against {n} replicas on one database "
                          f"(clients round_robin over them); CPU ms per verb = cores / verbs/s, medians over interleaved reps",
            "forwarded_fraction": "temper_scheduler_forwarded_total summed over the replicas, its increase in the window / verbs answered",
            "failover": "per run on the killed replica's lanes: SIGKILL -> the first answer of an attempt sent after it",
        },
    }


def run(args, scheduler_env: dict[str, str], describe: dict) -> dict:
    """Start the stacks, measure, stop them; the result (written to results/scaleout-replicas.json / .png)."""
    import json
    import os
    import secrets
    import shutil
    import tempfile

    from tqdm import tqdm

    from scaleout_procs import DEFAULT_SERVER, start_all

    started = time.perf_counter()
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="temper-scaleout-replicas-"))
    log_dir = work / "logs"
    log_dir.mkdir()
    databases = Databases(args.database_url or DEFAULT_SERVER, None)
    env = {"TEMPER_SCHEDULER_REPLICAS": "true", "TEMPER_SCHEDULER_LEASE_SECONDS": repr(args.lease_seconds)}
    stacks = {"ceiling": Stack("ceiling", args.ceiling_trainers, 0.0, env=env),
              "replicas": Stack("replicas", args.ceiling_trainers, 0.0, env=env, replica_count=args.replicas)}
    floors = [Stack("floor", 0, 0.0), Stack("durable_floor", 0, 0.0)]
    progress = tqdm(total=len(stacks) * 2 + 2 + args.reps * len(VARIANTS) + 1, desc="scaleout --replicas", unit="step", file=sys.stderr)
    token = secrets.token_urlsafe(32)
    failed, kept_logs, measured = True, None, None
    try:
        start_all(stacks, floors, databases, log_dir, token, scheduler_env, args.tenants, progress)
        deliberate: set[int] = set()  # the pid the failover SIGKILLs
        measured = asyncio.run(guarded(measure(args, stacks, databases, progress, deliberate), stacks, deliberate))
        failed = measured["clients"].error_count > 0
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

    result = summarize(args, measured)
    result["config"] = {
        "replicas": args.replicas, "lease_seconds": args.lease_seconds, "trainers": args.ceiling_trainers,
        "ceiling_runs": args.ceiling_runs, "tenants": args.tenants, "window": args.window, "small_tokens": args.small_tokens,
        "reps": args.reps, "warmup_s": args.warmup, "duration_s": args.duration, "quick": args.quick,
        "failover_timeout_s": args.failover_timeout, "failover_retry_delay_s": args.failover_retry_delay,
        "database": "postgresql", "scheduler_env": {**scheduler_env, **env}, "samplers_per_stack": 1,
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(), **describe,
    }
    result["logs"] = kept_logs
    result["total_seconds"] = time.perf_counter() - started
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "scaleout-replicas.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / "scaleout-replicas.png")
    report(result)
    return result
