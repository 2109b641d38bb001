"""The scale-out benchmark's processes: scheduler and fake-worker subprocesses, a fresh database per
stack, the bare gRPC floor server, API keys, and the CPU each process used (``scaleout.py``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import fake_workers  # this script's folder is first on sys.path
from harness import cpu_seconds
from scaleout_runs import Run, Tenant
from temper.localstack import READY_PREFIX, parse_ready_line


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_SERVER = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"


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


def scrape_counter(metrics_port: int | None, name: str) -> float | None:
    """A counter of a scheduler's /metrics, summed over its labels (e.g. temper_scheduler_cycles_total)."""
    if not metrics_port:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def scrape_cycles(metrics_port: int | None) -> float | None:
    """The scheduler's temper_scheduler_cycles_total, all outcomes."""
    return scrape_counter(metrics_port, "temper_scheduler_cycles_total")


def scrape_sum(ports: list[int | None], name: str) -> float | None:
    """A counter summed over several schedulers (replicas); None if one of them did not answer."""
    values = [scrape_counter(port, name) for port in ports]
    return None if not values or any(v is None for v in values) else sum(values)


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
    replica_count: int = 1     # scheduler processes on the stack's one database (--replicas)
    env: dict[str, str] = field(default_factory=dict)  # this stack's schedulers' own environment
    replicas: list[Proc] = field(default_factory=list)  # the schedulers after the first (replica_count > 1)

    @property
    def schedulers(self) -> list[Proc]:
        return [self.scheduler, *self.replicas]

    @property
    def address(self) -> str:
        """Every scheduler's address, comma-separated: with several, clients use round_robin over them."""
        return ",".join(f"127.0.0.1:{proc.ready['port']}" for proc in self.schedulers)

    @property
    def metrics_port(self) -> int | None:
        port = self.scheduler.ready.get("metrics_port")
        return int(port) if port else None

    @property
    def metrics_ports(self) -> list[int | None]:
        return [int(p.ready["metrics_port"]) if p.ready.get("metrics_port") else None for p in self.schedulers]

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role; "scheduler" is every replica (their CPU is summed), "scheduler-<i>" each one."""
        out = {"scheduler": [p.process.pid for p in self.schedulers], **({"workers": [self.workers.process.pid]} if self.workers else {})}
        if self.replicas:
            out.update({f"scheduler-{i}": [p.process.pid] for i, p in enumerate(self.schedulers)})
        return out


def start_stacks(stacks: list[Stack], databases: Databases, log_dir: Path, token: str, scheduler_env: dict[str, str],
                 progress) -> None:
    """Every stack's fake workers, then its scheduler (which waits for them), all at once."""
    for stack in stacks:
        stack.database_url, stack.database_name = databases.create(stack.name)
        stack.workers = launch(f"{stack.name}-workers", [
            sys.executable, str(HERE / "fake_workers.py"), "--trainers", str(stack.trainers), "--samplers", "1",
            "--seconds-per-1k-tokens", repr(stack.seconds_per_1k_tokens)], {fake_workers.TOKEN_ENV: token}, log_dir)
    environments = {}
    for stack in stacks:
        ready = stack.workers.wait_ready(120)
        environments[stack.name] = {
            "TEMPER_SCHEDULER_BIND": "127.0.0.1:0", "TEMPER_SCHEDULER_METRICS_BIND": "127.0.0.1:0",
            "TEMPER_SCHEDULER_DATABASE_URL": stack.database_url, "TEMPER_SCHEDULER_TRAINER_ADDRESSES": ready["trainers"],
            "TEMPER_SCHEDULER_SAMPLER_ADDRESSES": ready["samplers"], "TEMPER_SCHEDULER_INTERNAL_TOKEN": token,
            **scheduler_env, **stack.env}
        stack.scheduler = launch(f"{stack.name}-scheduler", [sys.executable, "-m", "temper.scheduler"], environments[stack.name], log_dir)
    for stack in stacks:
        stack.scheduler.wait_ready(300)
    # further replicas once the first has migrated the database: same workers, same database (as LocalStack)
    for stack in stacks:
        stack.replicas = [launch(f"{stack.name}-scheduler-{i}", [sys.executable, "-m", "temper.scheduler"], environments[stack.name],
                                 log_dir) for i in range(1, stack.replica_count)]
    for stack in stacks:
        for proc in stack.replicas:
            proc.wait_ready(300)
        progress.update()


def start_floor(stack: Stack, log_dir: Path, databases: Databases | None = None) -> None:
    """The bare gRPC server (grpc_floor.py) as the stack's "scheduler": no workers, no database; with
    ``databases``, the durable floor (durable_floor.py) on a fresh database of its own."""
    argv = [sys.executable, str(HERE / "grpc_floor.py"), "--bind", "127.0.0.1:0"]
    if databases is not None:
        stack.database_url, stack.database_name = databases.create(stack.name)
        argv = [sys.executable, str(HERE / "durable_floor.py"), "--bind", "127.0.0.1:0", "--database-url", stack.database_url]
    stack.scheduler = launch(stack.name, argv, {}, log_dir)
    stack.scheduler.wait_ready(120)


def start_all(stacks: dict, floors: list[Stack], databases: Databases, log_dir: Path, token: str, scheduler_env: dict[str, str],
              tenants: int, progress) -> None:
    """Start the schedulers and fake workers of ``stacks``, then the floors (added to ``stacks``), then
    every stack's tenants (API keys; the floors' are placeholders: they check none)."""
    progress.set_postfix_str("starting schedulers and fake workers")
    start_stacks(list(stacks.values()), databases, log_dir, token, scheduler_env, progress)
    for floor in floors:
        stacks[floor.name] = floor
        start_floor(floor, log_dir, databases if floor.name == "durable_floor" else None)
    progress.set_postfix_str("API keys")
    for stack in stacks.values():
        if stack in floors:
            stack.tenants = [Tenant(f"tenant-{i:02d}", "none") for i in range(tenants)]
            continue
        make_tenants(stack, tenants)
        progress.update()


def make_tenants(stack: Stack, count: int) -> None:
    """``count`` tenants with an API key each (``temper.scheduler.admin.create_key``: once the
    scheduler is up, the schema is there and each key is one insert)."""
    from temper.scheduler.admin import create_key

    for i in range(count):
        name = f"tenant-{i:02d}"
        stack.tenants.append(Tenant(name, create_key(stack.database_url, name, label="scaleout")))


class Usage:
    """CPU seconds of the stack's processes, this process and the database, and machine ticks."""

    def __init__(self, stack: Stack, databases: Databases):
        self.stack, self.databases = stack, databases

    async def snapshot(self) -> dict:
        db_pids = await asyncio.to_thread(self.databases.backend_pids, self.stack.database_name) if self.stack.database_name else []
        ports = self.stack.metrics_ports if self.stack.scheduler.ready.get("metrics_port") else []
        cycles = await asyncio.to_thread(scrape_sum, ports, "temper_scheduler_cycles_total")
        forwarded = await asyncio.to_thread(scrape_sum, ports, "temper_scheduler_forwarded_total") if self.stack.replicas else None
        pids = {**self.stack.pids(), "client": [os.getpid()]}
        return {"t": time.monotonic(), "cpu": {k: cpu_seconds(p) for k, p in pids.items()},
                "db_pids": {p: cpu_seconds([p]) for p in db_pids}, "machine": machine_ticks(), "cycles": cycles,
                "forwarded": forwarded}

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
                "scheduler_cycles": (b["cycles"] - a["cycles"]) if a["cycles"] is not None and b["cycles"] is not None else None,
                "forwarded": (b["forwarded"] - a["forwarded"]) if a["forwarded"] is not None and b["forwarded"] is not None else None}
