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
                    trainer); the ceiling is also read as a fraction of that transport floor.
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

The last stdout line is the result JSON; it is also written to benchmarks/results/scaleout.json, with
a plot in benchmarks/results/scaleout.png.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

import fake_workers  # this script's folder is first on sys.path
from harness import cpu_seconds
from temper.common.auth import bearer_metadata
from temper.common.codec import encode_array, encode_tokens
from temper.common.errors import is_hard_limit
from temper.common.server_options import CHANNEL_OPTIONS
from temper.localstack import READY_PREFIX, parse_ready_line
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_SERVER = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
FB, OPT = "forward_backward", "optim_step"
SMALL = ("ceiling", "floor")  # the variants driven with the small verbs
GOAL_FRACTION = 0.9
RETRY_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
ADAM = types_pb2.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
LORA = types_pb2.LoraConfig(rank=8, train_attn=True, train_mlp=True)


# ---- processes and databases ----------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    process: subprocess.Popen
    log_path: Path
    ready: dict = field(default_factory=dict)

    def wait_ready(self, timeout: float) -> dict:
        """The ``TEMPER_READY`` line's fields (the process writes its log to a file; we read it back)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            for line in text.splitlines():
                if line.startswith(READY_PREFIX):
                    self.ready = parse_ready_line(line)
                    return self.ready
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
        raise RuntimeError(f"{self.name} did not start (exit {self.process.poll()}; log {self.log_path}):\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def launch(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    return Proc(name, process, log_path)


class Databases:
    """A fresh database per stack: on a PostgreSQL server (dropped at the end), or SQLite files."""

    def __init__(self, server_url: str | None, sqlite_dir: Path | None):
        self.server_url, self.sqlite_dir = server_url, sqlite_dir
        self.created: list[str] = []

    def _admin(self):
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        return create_engine(self.server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool,
                             connect_args={"connect_timeout": 5})

    def create(self, label: str) -> tuple[str, str]:
        """(URL, database name) of a new empty database."""
        name = f"temper_scaleout_{label}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        if self.sqlite_dir is not None:
            return f"sqlite:///{self.sqlite_dir / (name + '.db')}", name
        from sqlalchemy import text
        from sqlalchemy.engine import make_url

        engine = self._admin()
        try:
            with engine.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        self.created.append(name)
        url = make_url(self.server_url).set(database=name)
        return url.render_as_string(hide_password=False), name

    def backend_pids(self, name: str) -> list[int]:
        """The server processes serving database ``name`` now (PostgreSQL only; their CPU is the database's)."""
        if self.sqlite_dir is not None:
            return []
        from sqlalchemy import text

        engine = self._admin()
        try:
            with engine.connect() as conn:
                return [int(p) for p in conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = :n"), {"n": name}).scalars()]
        except Exception:  # noqa: BLE001 - a diagnostic only
            return []
        finally:
            engine.dispose()

    def drop_all(self) -> None:
        if not self.created:
            return
        from sqlalchemy import text

        engine = self._admin()
        try:
            with engine.connect() as conn:
                for name in self.created:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            engine.dispose()
        self.created.clear()


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine (/proc/stat), for its busy fraction."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def scrape_cycles(metrics_port: int | None) -> float | None:
    """The scheduler's temper_scheduler_cycles_total, all outcomes."""
    if not metrics_port:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("temper_scheduler_cycles_total{"))


# ---- clients --------------------------------------------------------------------------------------


@dataclass
class Tenant:
    name: str
    key: str
    channel: grpc.aio.Channel | None = None
    stub: service_pb2_grpc.TemperStub | None = None
    metadata: tuple = ()
    session_id: str = ""


@dataclass
class Run:
    id: str
    tenant: Tenant
    data: list                 # the forward_backward's datums
    tokens: int                # forward_backward tokens
    next_seq: int = 1
    trainers: set = field(default_factory=set)  # fake trainer indexes its answers came from

    def take_seq(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq


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

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.retries: Counter = Counter()
        self.errors: list[str] = []
        self.error_count = 0

    async def send(self, run: Run, seq: int, sink: list[Done]) -> None:
        """Seq ids alternate forward_backward (odd) and optim_step (even)."""
        tenant = run.tenant
        if seq % 2:
            kind, method, tokens = FB, tenant.stub.ForwardBackward, run.tokens
            request = service_pb2.ForwardBackwardRequest(training_run_id=run.id, seq_id=seq, data=run.data, loss_fn="cross_entropy")
        else:
            kind, method, tokens = OPT, tenant.stub.OptimStep, 0
            request = service_pb2.OptimStepRequest(training_run_id=run.id, seq_id=seq, adam_params=ADAM)
        sent, delay = time.monotonic(), 0.02
        while True:
            try:
                answer = await method(request, metadata=tenant.metadata, timeout=self.timeout)
                break
            except grpc.aio.AioRpcError as err:
                if err.code() in RETRY_CODES and not is_hard_limit(err.code(), err.details()):
                    self.retries[err.code().name] += 1  # backpressure: the same seq again, as the client library does
                    await asyncio.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, 1.0)
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
                         metrics.get(fake_workers.M_START), metrics.get(fake_workers.M_END)))


# ---- stacks ---------------------------------------------------------------------------------------


@dataclass
class Stack:
    name: str
    trainers: int
    seconds_per_1k_tokens: float
    database_url: str = ""
    database_name: str = ""
    workers: Proc | None = None
    scheduler: Proc | None = None
    tenants: list[Tenant] = field(default_factory=list)
    runs: dict[str, list[Run]] = field(default_factory=dict)  # workload name -> its runs

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler.ready['port']}"

    @property
    def metrics_port(self) -> int | None:
        port = self.scheduler.ready.get("metrics_port")
        return int(port) if port else None

    def pids(self) -> dict[str, int]:
        return {"scheduler": self.scheduler.process.pid, **({"workers": self.workers.process.pid} if self.workers else {})}


def start_stacks(stacks: list[Stack], databases: Databases, log_dir: Path, token: str, scheduler_env: dict[str, str],
                 progress) -> None:
    """Every stack's fake workers, then its scheduler (which waits for them), all at once."""
    for stack in stacks:
        stack.database_url, stack.database_name = databases.create(stack.name)
        stack.workers = launch(f"{stack.name}-workers", [
            sys.executable, str(HERE / "fake_workers.py"), "--trainers", str(stack.trainers), "--samplers", "1",
            "--seconds-per-1k-tokens", repr(stack.seconds_per_1k_tokens)], {fake_workers.TOKEN_ENV: token}, log_dir)
    for stack in stacks:
        ready = stack.workers.wait_ready(120)
        stack.scheduler = launch(f"{stack.name}-scheduler", [sys.executable, "-m", "temper.scheduler"], {
            "TEMPER_SCHEDULER_BIND": "127.0.0.1:0", "TEMPER_SCHEDULER_METRICS_BIND": "127.0.0.1:0",
            "TEMPER_SCHEDULER_DATABASE_URL": stack.database_url, "TEMPER_SCHEDULER_TRAINER_ADDRESSES": ready["trainers"],
            "TEMPER_SCHEDULER_SAMPLER_ADDRESSES": ready["samplers"], "TEMPER_SCHEDULER_INTERNAL_TOKEN": token,
            **scheduler_env}, log_dir)
    for stack in stacks:
        stack.scheduler.wait_ready(300)
        progress.update()


def start_floor(stack: Stack, log_dir: Path) -> None:
    """The bare gRPC server (grpc_floor.py) as the stack's "scheduler": no workers, no database."""
    stack.scheduler = launch(stack.name, [sys.executable, str(HERE / "grpc_floor.py"), "--bind", "127.0.0.1:0"], {}, log_dir)
    stack.scheduler.wait_ready(120)


def make_tenants(stack: Stack, count: int) -> None:
    """``count`` tenants with an API key each (``temper.scheduler.admin.create_key``: once the
    scheduler is up, the schema is there and each key is one insert)."""
    from temper.scheduler.admin import create_key

    for i in range(count):
        name = f"tenant-{i:02d}"
        stack.tenants.append(Tenant(name, create_key(stack.database_url, name, label="scaleout")))


async def connect(stack: Stack) -> None:
    for tenant in stack.tenants:
        tenant.channel = grpc.aio.insecure_channel(stack.address, options=CHANNEL_OPTIONS)
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


class Usage:
    """CPU seconds of the stack's processes, this process and the database, and machine ticks."""

    def __init__(self, stack: Stack, databases: Databases):
        self.stack, self.databases = stack, databases

    async def snapshot(self) -> dict:
        db_pids = await asyncio.to_thread(self.databases.backend_pids, self.stack.database_name) if self.stack.database_name else []
        cycles = await asyncio.to_thread(scrape_cycles, self.stack.metrics_port)
        pids = {**self.stack.pids(), "client": os.getpid()}
        return {"t": time.monotonic(), "cpu": {k: cpu_seconds([p]) for k, p in pids.items()},
                "db_pids": {p: cpu_seconds([p]) for p in db_pids}, "machine": machine_ticks(), "cycles": cycles}

    @staticmethod
    def between(a: dict, b: dict) -> dict:
        seconds = b["t"] - a["t"]
        cores = {k: (b["cpu"][k] - a["cpu"][k]) / seconds for k in a["cpu"]}
        # the database's server processes at the end, from their CPU at the start (0 for ones opened since);
        # a connection the scheduler's pool closed within the window is missed
        cores["database"] = sum(v - a["db_pids"].get(p, 0.0) for p, v in b["db_pids"].items()) / seconds if b["db_pids"] else None
        busy = b["machine"][0] - a["machine"][0]
        total = b["machine"][1] - a["machine"][1]
        return {"cores": cores, "machine_busy_fraction": busy / total if total else None,
                "scheduler_cycles": (b["cycles"] - a["cycles"]) if a["cycles"] is not None and b["cycles"] is not None else None}


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
    return {"done": done, "window": (first["t"], last["t"]), "usage": Usage.between(first, last)}


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
    return {"done": done, "window": (first["t"], last["t"]), "usage": Usage.between(first, last), "sent": i}


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


def source_digests() -> dict:
    """Which scheduler was measured: short sha256 of its loop's files (they change often) and git's view."""
    out = {}
    for rel in ("scheduler/loop.py", "scheduler/lanes.py", "scheduler/backends.py", "scheduler/policy.py", "scheduler/admission.py"):
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
    await create_runs(stacks["floor"], "small", args.ceiling_runs, small)
    await create_runs(stacks[f"n{max(args.trainers)}"], "small", args.ceiling_runs, small)
    progress.update()

    variants = [f"n{n}" for n in throughput_ns] + ["ceiling", "floor"]
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
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--sqlite", action="store_true", help="SQLite files in a temporary folder instead of PostgreSQL")
    parser.add_argument("--scheduler-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the schedulers (e.g. TEMPER_SCHEDULER_LOG_LEVEL=WARNING); repeatable")
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
    scheduler_env = dict(item.split("=", 1) for item in args.scheduler_env)

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
    floor = Stack("floor", 0, 0.0)
    variants = 2 if args.only == "ceiling" else len(args.trainers) + 2
    progress = tqdm(total=len(stacks) * 2 + 2 + args.reps * variants + 1, desc="scaleout", unit="step", file=sys.stderr)
    token = secrets.token_urlsafe(32)
    failed, kept_logs = True, None
    try:
        progress.set_postfix_str("starting schedulers and fake workers")
        start_stacks(list(stacks.values()), databases, log_dir, token, scheduler_env, progress)
        stacks["floor"] = floor
        start_floor(floor, log_dir)
        progress.set_postfix_str("API keys")
        for stack in stacks.values():
            if stack is floor:
                stack.tenants = [Tenant(f"tenant-{i:02d}", "none") for i in range(args.tenants)]
                continue
            make_tenants(stack, args.tenants)
            progress.update()
        progress.set_postfix_str("sessions and runs")
        measured = asyncio.run(measure(args, stacks, databases, progress))
        failed = measured["clients"].error_count > 0  # the schedulers' logs say why: kept
    finally:
        progress.close()
        for stack in stacks.values():
            for proc in (stack.scheduler, stack.workers):
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
