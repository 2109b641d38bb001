"""The scale-out benchmark's clients and load: raw public-API gRPC calls per tenant, closed- and
open-loop drivers, and what the answers say (tokens/s, verbs/s, latency percentiles) (``scaleout.py``)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

import fake_workers  # this script's folder is first on sys.path
from scaleout_runs import Run, Tenant
from temper.common.auth import bearer_metadata
from temper.common.channel_target import channel_target
from temper.common.codec import encode_array, encode_tokens
from temper.common.errors import is_hard_limit
from temper.common.owner_hints import owner_in
from temper.common.server_options import CHANNEL_OPTIONS
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2

if TYPE_CHECKING:
    from scaleout_procs import Stack, Usage


FB, OPT = "forward_backward", "optim_step"
RETRY_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
ADAM = types_pb2.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
LORA = types_pb2.LoraConfig(rank=8, train_attn=True, train_mlp=True)


# ---- clients --------------------------------------------------------------------------------------


@dataclass
class Done:
    kind: str
    run: Run
    sent: float
    answered: float
    tokens: int
    trainer: int
    cycle: int
    start: float | None        # the fake worker's cycle, CLOCK_MONOTONIC
    end: float | None
    last_try: float = 0.0      # when the attempt that got the answer was sent (after resends: the last one)


def make_data(datums: int, tokens: int, rng: np.random.Generator) -> list:
    """``datums`` cross-entropy datums of ``tokens`` tokens each, as a client encodes them."""
    out = []
    for _ in range(datums):
        seq = rng.integers(0, fake_workers.VOCAB_SIZE, tokens + 1, dtype=np.int64)
        chunk = types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(seq[:-1])))
        out.append(types_pb2.Datum(model_input=types_pb2.ModelInput(chunks=[chunk]),
                                   loss_fn_inputs={"target_tokens": encode_array(seq[1:], "int64"),
                                                   "weights": encode_array(np.ones(tokens, np.float32), "float32")}))
    return out


class Clients:
    """Sends the verbs, resends backpressure, records each answer."""

    def __init__(self, timeout: float, max_retry_delay: float = 1.0):
        self.timeout = timeout
        self.max_retry_delay = max_retry_delay  # the resends' backoff cap
        self.retries: Counter = Counter()
        self.errors: list[str] = []
        self.error_count = 0
        # hinted: each run's verbs go to the replica its last answer named in temper-lane-owner (as
        # temper.client does with several replicas, common/owner_hints.py); UNAVAILABLE there drops it
        self.hinted = False
        self._owner_channels: dict[str, grpc.aio.Channel] = {}
        self._owner_stubs: dict[str, service_pb2_grpc.TemperStub] = {}

    def _owner_stub(self, address: str | None) -> service_pb2_grpc.TemperStub | None:
        if address is None:
            return None
        stub = self._owner_stubs.get(address)
        if stub is None:
            channel = self._owner_channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            stub = self._owner_stubs[address] = service_pb2_grpc.TemperStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._owner_channels.values():
            await channel.close()

    async def send(self, run: Run, seq: int, sink: list[Done]) -> None:
        """Seq ids alternate forward_backward (odd) and optim_step (even)."""
        tenant = run.tenant
        if seq % 2:
            kind, method, tokens = FB, "ForwardBackward", run.tokens
            request = service_pb2.ForwardBackwardRequest(training_run_id=run.id, seq_id=seq, data=run.data, loss_fn="cross_entropy")
        else:
            kind, method, tokens = OPT, "OptimStep", 0
            request = service_pb2.OptimStepRequest(training_run_id=run.id, seq_id=seq, adam_params=ADAM)
        sent, delay = time.monotonic(), 0.02
        while True:
            last_try = time.monotonic()
            hinted = run.owner_stub if self.hinted and run.stub is None else None
            try:
                if self.hinted and run.stub is None:
                    call = getattr(hinted or tenant.stub, method)(request, metadata=tenant.metadata, timeout=self.timeout)
                    answer = await call
                    run.owner_stub = self._owner_stub(owner_in(await call.trailing_metadata())) or run.owner_stub
                else:
                    answer = await getattr(run.stub or tenant.stub, method)(request, metadata=tenant.metadata, timeout=self.timeout)
                break
            except grpc.aio.AioRpcError as err:
                if hinted is not None and err.code() == grpc.StatusCode.UNAVAILABLE:
                    run.owner_stub = None  # the hinted owner is gone: resent at once through round_robin
                    self.retries["hint dropped"] += 1
                    continue
                if err.code() in RETRY_CODES and not is_hard_limit(err.code(), err.details()):
                    self.retries[err.code().name] += 1  # backpressure: the same seq again, as the client library does
                    await asyncio.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, self.max_retry_delay)
                    continue
                self.error_count += 1
                if len(self.errors) < 10:
                    self.errors.append(f"{kind} {run.id}#{seq}: {err.code().name}: {err.details()}")
                return
        answered = time.monotonic()
        metrics = answer.metrics
        trainer = int(metrics.get(fake_workers.M_TRAINER, -1))
        run.trainers.add(trainer)
        sink.append(Done(kind, run, sent, answered, tokens, trainer, int(metrics.get(fake_workers.M_CYCLE, -1)),
                         metrics.get(fake_workers.M_START), metrics.get(fake_workers.M_END), last_try))


async def connect(stack: Stack) -> None:
    # several replicas: one comma-separated list with round_robin, as temper.client reads it
    target, options = channel_target(stack.address) if "," in stack.address else (stack.address, CHANNEL_OPTIONS)
    for tenant in stack.tenants:
        tenant.channel = grpc.aio.insecure_channel(target, options=options)
        tenant.stub = service_pb2_grpc.TemperStub(tenant.channel)
        tenant.metadata = (bearer_metadata(tenant.key),)
        session = await tenant.stub.CreateSession(service_pb2.CreateSessionRequest(tags=["scaleout"]), metadata=tenant.metadata,
                                                  timeout=300, wait_for_ready=True)
        tenant.session_id = session.session_id


async def create_runs(stack: Stack, workload: str, count: int, data: list) -> list[Run]:
    """``count`` runs, tenants in turn; one after another, so the scheduler places them evenly."""
    tokens = sum(fake_workers.datum_tokens(d) for d in data)
    runs = []
    for i in range(count):
        tenant = stack.tenants[i % len(stack.tenants)]
        info = await tenant.stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
            session_id=tenant.session_id, base_model=fake_workers.MODEL, lora_config=LORA), metadata=tenant.metadata,
            timeout=300, wait_for_ready=True)
        runs.append(Run(info.training_run_id, tenant, data, tokens, next_seq=info.next_seq_id or 1))
    stack.runs[workload] = runs
    return runs


async def closed_loop(clients: Clients, runs: list[Run], window: int, warmup: float, duration: float, usage: Usage) -> dict:
    """Every run keeps ``window`` requests in flight for warmup + duration; then no new ones, and the
    ones in flight are answered (the stack is idle again). The measured window is the last ``duration``."""
    done: list[Done] = []
    stop = asyncio.Event()

    async def drive(run: Run) -> None:
        slots, flying = asyncio.Semaphore(window), set()
        while True:
            await slots.acquire()
            if stop.is_set():
                break
            task = asyncio.create_task(clients.send(run, run.take_seq(), done))
            flying.add(task)
            task.add_done_callback(lambda t: (flying.discard(t), slots.release()))
        await asyncio.gather(*flying)

    drivers = [asyncio.create_task(drive(run)) for run in runs]
    await asyncio.sleep(warmup)
    first = await usage.snapshot()
    await asyncio.sleep(duration)
    last = await usage.snapshot()
    stop.set()
    await asyncio.gather(*drivers)
    return {"done": done, "window": (first["t"], last["t"]), "usage": usage.between(first, last)}


async def open_loop(clients: Clients, runs: list[Run], rate: float, warmup: float, duration: float, usage: Usage,
                    seed: int) -> dict:
    """Poisson arrivals at ``rate`` verbs/s, two per run in turn (a forward_backward, then its optim_step), for
    warmup + duration; requests sent during the last ``duration`` are the measured ones."""
    rng = random.Random(seed)
    done: list[Done] = []
    tasks = set()
    begin = time.monotonic()
    end, next_at, i, first = begin + warmup + duration, begin, 0, None
    while next_at < end:
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if first is None and time.monotonic() >= begin + warmup:
            first = await usage.snapshot()
        run = runs[(i // 2) % len(runs)]  # a forward_backward, then its optim_step, then the next run's
        i += 1
        task = asyncio.create_task(clients.send(run, run.take_seq(), done))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate)
    last = await usage.snapshot()
    await asyncio.gather(*tasks)
    first = first or last
    return {"done": done, "window": (first["t"], last["t"]), "usage": usage.between(first, last), "sent": i}


# ---- what the measurements say ----------------------------------------------------------------------


def tokens_per_second(done: list[Done], window: tuple[float, float], trainers: int) -> dict:
    """Per trainer: forward_backward tokens of its cycles that ended in the window after its first
    one there, over the time from its first to its last cycle end there; summed over trainers."""
    w0, w1 = window
    cycles: dict[tuple[int, int], list] = {}
    for d in done:
        if d.kind == FB and d.end is not None and w0 <= d.end <= w1:
            entry = cycles.setdefault((d.trainer, d.cycle), [d.end, 0, d.start])
            entry[1] += d.tokens
    per_trainer, busy = {}, 0.0
    for index in range(trainers):
        mine = sorted(v for (t, _), v in cycles.items() if t == index)
        busy += sum(end - start for end, _, start in mine)
        if len(mine) >= 2:
            per_trainer[index] = sum(tokens for _, tokens, _ in mine[1:]) / (mine[-1][0] - mine[0][0])
        else:  # too few cycles in the window to time between cycle ends
            per_trainer[index] = sum(tokens for _, tokens, _ in mine) / (w1 - w0)
    answered = sum(d.tokens for d in done if d.kind == FB and w0 <= d.answered <= w1) / (w1 - w0)
    return {"tokens_per_s": sum(per_trainer.values()), "answered_tokens_per_s": answered,
            "per_trainer_tokens_per_s": [per_trainer[i] for i in range(trainers)],
            "cycles_in_window": len(cycles), "trainer_busy_fraction": busy / (trainers * (w1 - w0))}


def verbs_per_second(done: list[Done], window: tuple[float, float]) -> float:
    w0, w1 = window
    return sum(1 for d in done if w0 <= d.answered <= w1) / (w1 - w0)


def percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    arr = np.asarray(values) * 1000.0
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)), "mean": float(arr.mean()), "n": len(values)}


def latency_summary(done: list[Done], window: tuple[float, float]) -> dict:
    """Per verb: latency, the worker's time on the verb's cycle, their difference (what the scheduler
    adds), and that split into before the cycle started and after it ended."""
    w0, w1 = window
    measured = [d for d in done if w0 <= d.sent <= w1 and d.start is not None and d.end is not None]
    out = {}
    for verb, subset in ((FB, [d for d in measured if d.kind == FB]), (OPT, [d for d in measured if d.kind == OPT]),
                         ("all", measured)):
        out[verb] = {
            "added_ms": percentiles_ms([(d.answered - d.sent) - (d.end - d.start) for d in subset]),
            "latency_ms": percentiles_ms([d.answered - d.sent for d in subset]),
            "worker_ms": percentiles_ms([d.end - d.start for d in subset]),
            "before_worker_ms": percentiles_ms([d.start - d.sent for d in subset]),
            "after_worker_ms": percentiles_ms([d.answered - d.end for d in subset]),
        }
    return out


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def summarize_ceiling(args, samples: dict) -> dict:
    c, floor = samples["ceiling"], median([s["verbs_per_s"] for s in samples["floor"]])
    ceiling = median([s["verbs_per_s"] for s in c])
    return {
        "verbs_per_s": ceiling,
        "grpc_floor_verbs_per_s": floor, "grpc_floor_samples_verbs_per_s": [s["verbs_per_s"] for s in samples["floor"]],
        "grpc_floor_cores": {k: median([s["usage"]["cores"].get(k) for s in samples["floor"]]) for k in ("scheduler", "client")},
        "fraction_of_grpc_floor": ceiling / floor if ceiling and floor else None,
        "samples_verbs_per_s": [s["verbs_per_s"] for s in c],
        "trainers": args.ceiling_trainers, "runs": args.ceiling_runs, "tenants": args.tenants, "window_per_run": args.window,
        "cores": {k: median([s["usage"]["cores"].get(k) for s in c]) for k in ("scheduler", "workers", "client", "database")},
        "machine_busy_fraction": median([s["usage"]["machine_busy_fraction"] for s in c]),
        "verbs_per_cycle": median([s["verbs_per_s"] * args.duration / s["usage"]["scheduler_cycles"]
                                   for s in c if s["usage"]["scheduler_cycles"]]),
        **(durable_floor(samples["durable_floor"], ceiling) if "durable_floor" in samples else {}),
    }


def durable_floor(d: list[dict], ceiling: float | None) -> dict:
    """The durable floor (durable_floor.py): the bare server plus two group-committed Postgres writes per verb."""
    rate = median([s["verbs_per_s"] for s in d])
    return {"durable_floor_verbs_per_s": rate, "durable_floor_samples_verbs_per_s": [s["verbs_per_s"] for s in d],
            "durable_floor_cores": {k: median([s["usage"]["cores"].get(k) for s in d]) for k in ("scheduler", "client", "database")},
            "ceiling_fraction_of_durable_floor": ceiling / rate if ceiling and rate else None}
