"""Start scheduler, trainer and sampler as separate local processes on loopback ports.

A development and test harness (`make demo`, recipes, integration tests, benchmarks), not part of
any service. Each service binds port 0 for gRPC and for its /metrics endpoint and prints
"TEMPER_READY <role> port=<n> metrics_port=<m>"; we read that line instead of guessing free ports.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from temper.forked_process import ForkServer, can_fork_into, forkserver_wanted

READY_PREFIX = "TEMPER_READY "
LOCAL_TENANT = "local"
MODULES = {"scheduler": "temper.scheduler", "trainer": "temper.services.trainer", "sampler": "temper.services.sampler",
           "gateway": "temper.services.gateway"}


@dataclass
class Service:
    role: str                 # scheduler | trainer | sampler
    name: str                 # unique in the stack: the role, then role-1, role-2, ... for more of it
    process: subprocess.Popen
    log_path: Path
    env: dict[str, str]  # the role's own settings, without bind addresses (reused by restarts)
    port: int = 0
    metrics_port: int | None = None  # None until ready, or when the process serves no metrics
    registry_port: int | None = None  # the scheduler's worker registry, when it serves one
    lines: "queue.Queue[str]" = field(default_factory=queue.Queue)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else f"http://127.0.0.1:{self.metrics_port}/metrics"


def parse_ready_line(line: str) -> dict[str, str]:
    """``TEMPER_READY trainer port=1 metrics_port=2`` -> {"role": "trainer", "port": "1", "metrics_port": "2"}."""
    _, role, *pairs = line.split()
    return {"role": role, **dict(pair.split("=", 1) for pair in pairs if "=" in pair)}


def _pump(service: Service, log) -> None:
    with log:
        for line in service.process.stdout:
            log.write(line)
            log.flush()
            if line.startswith(READY_PREFIX):
                service.lines.put(line)
    service.lines.put("")


def _tail(service: Service, offset: int) -> None:
    """A forked service writes its log itself (temper/forked_process.py): read it from ``offset`` until
    the ready line, or until the process ends."""
    with open(service.log_path, errors="replace") as log:
        log.seek(offset)
        partial = ""
        while True:
            chunk = log.readline()
            if not chunk:
                if service.process.poll() is None:
                    time.sleep(0.05)
                    continue
                chunk = log.readline()  # what it wrote just before it ended
                if not chunk:
                    break
            partial += chunk
            if partial.endswith("\n"):
                if partial.startswith(READY_PREFIX):
                    service.lines.put(partial)
                    return
                partial = ""
    service.lines.put("")


class LocalStack:
    def __init__(self, base_model: str, data_dir: Path, database_url: str | None = None, extra_env: dict[str, str] | None = None,
                 num_threads: int = 0, num_trainers: int = 1, num_samplers: int = 1, registration: bool = False, gateway: bool = False,
                 trainer_world_size: int = 1, num_schedulers: int = 1):
        """``registration``: the scheduler serves a worker registry and starts first; the workers
        register with it (register_with) instead of being listed in its trainer/sampler addresses.
        ``trainer_world_size`` > 1: every trainer is a group of that many local processes (issue 20,
        services/trainer/group.py): rank 0 is the service ("trainer"), the others run as
        "<name>.rank<r>" (role "trainer-rank"); ``restart_group`` restarts them together."""
        self.base_model = base_model
        self.data_dir = Path(data_dir)
        self.database_url = database_url or f"sqlite:///{self.data_dir / 'temper.db'}"
        self.extra_env = extra_env or {}
        self.num_threads = num_threads
        self.counts = {"trainer": num_trainers, "sampler": num_samplers}
        self.gateway = gateway  # also start the Tinker gateway (HTTP, services/gateway) in front of the scheduler
        self.registration = registration
        self.trainer_world_size = trainer_world_size
        # > 1: that many scheduler replicas ("scheduler", "scheduler-1", ...) on one PostgreSQL database
        # (TEMPER_SCHEDULER_REPLICAS, docs/replicas.md); clients and the gateway get every address (round_robin)
        self.num_schedulers = num_schedulers
        self.services: list[Service] = []
        self._keys: dict[str, str] = {}
        self.api_key: str | None = None  # the LOCAL_TENANT's key, once started
        # The scheduler's credential to its trainer and sampler (common/internal_auth.py), new per stack.
        self.internal_token = secrets.token_urlsafe(32)
        # tests: fork the services from one warm process instead of importing torch in each (forked_process.py)
        self.forkserver = ForkServer.shared() if forkserver_wanted() else None

    def _launch(self, role: str, env: dict[str, str], port: int = 0, argv: list[str] | None = None, name: str | None = None) -> Service:
        """Start one process; its gRPC server on ``port`` (0: a free one), its metrics on a free port.
        ``argv`` replaces ``python -m <module>`` (e.g. a test's instrumented copy of the service)."""
        name = name or role
        log_path = self.data_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f"TEMPER_{role.upper()}_"
        binds = {f"{prefix}BIND": f"127.0.0.1:{port}", f"{prefix}METRICS_BIND": "127.0.0.1:0"}
        command = argv or [sys.executable, "-m", MODULES[role]]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env, **binds, **self.extra_env}
        if self.forkserver and command[1:] == ["-m", MODULES.get(role.removesuffix("-rank"))] and can_fork_into(full_env):
            log_path.touch()
            offset = log_path.stat().st_size
            service = Service(role, name, self.forkserver.spawn(command[2], full_env, log_path), log_path, env)
            threading.Thread(target=_tail, args=(service, offset), daemon=True).start()
        else:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
            service = Service(role, name, process, log_path, env)
            threading.Thread(target=_pump, args=(service, open(log_path, "a")), daemon=True).start()
        self.services.append(service)
        return service

    @staticmethod
    def _wait_ready(service: Service, timeout: float) -> Service:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = service.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line:
                ready = parse_ready_line(line)
                service.port = int(ready["port"])
                service.metrics_port = int(ready["metrics_port"]) if "metrics_port" in ready else None
                service.registry_port = int(ready["registry_port"]) if "registry_port" in ready else None
                return service
            if line == "" or service.process.poll() is not None or time.monotonic() > deadline:
                tail = service.log_path.read_text()[-3000:] if service.log_path.exists() else ""
                raise RuntimeError(f"{service.name} did not start (see {service.log_path}):\n{tail}")

    def _worker_env(self, role: str, name: str) -> dict[str, str]:
        prefix = f"TEMPER_{role.upper()}_"
        folder = {"trainer": ("CHECKPOINT_DIR", "checkpoints"), "sampler": ("ADAPTER_DIR", f"{name}-adapters")}[role]
        env = {f"{prefix}BASE_MODEL": self.base_model, f"{prefix}NUM_THREADS": str(self.num_threads),
               f"{prefix}{folder[0]}": str(self.data_dir / folder[1]), f"{prefix}INTERNAL_TOKEN": self.internal_token}
        if self.registration:
            env[f"{prefix}REGISTER_WITH"] = f"127.0.0.1:{self.service('scheduler').registry_port}"
        return env

    def start(self, timeout: float = 300.0) -> str:
        """Start the scheduler and its trainers and samplers; returns the scheduler's address. Trainers
        share one checkpoint folder (this machine's stand-in for durable storage); each sampler has its own.
        Static lists: the workers first, the scheduler then dials their addresses. Registration: the
        scheduler first (its registry's port is the workers' register_with), then the workers register."""
        try:
            if self.registration:
                scheduler = self._start_scheduler({"TEMPER_SCHEDULER_REGISTRY_BIND": "127.0.0.1:0"}, timeout)
                # a restarted scheduler serves its registry where the workers send their heartbeats
                scheduler.env["TEMPER_SCHEDULER_REGISTRY_BIND"] = f"127.0.0.1:{scheduler.registry_port}"
                self._start_workers(timeout)
                self.wait_registered(self.counts, timeout)
            else:
                self._start_workers(timeout)
                lists = {"TEMPER_SCHEDULER_TRAINER_ADDRESSES": ",".join(s.address for s in self.services_of("trainer")),
                         "TEMPER_SCHEDULER_SAMPLER_ADDRESSES": ",".join(s.address for s in self.services_of("sampler"))}
                if self.num_schedulers > 1:
                    lists["TEMPER_SCHEDULER_REPLICAS"] = "true"
                scheduler = self._start_scheduler(lists, timeout)
                for index in range(1, self.num_schedulers):
                    self._start_scheduler(lists, timeout, name=f"scheduler-{index}")
            self._start_gateway(timeout)
            self.api_key = self.key_for(LOCAL_TENANT)
        except BaseException:
            self.stop()
            raise
        return scheduler.address

    def _start_workers(self, timeout: float) -> None:
        """Every trainer and sampler of ``counts``, started together, each waited for."""
        started = [self._launch_worker(role, self._worker_env(role, name), name=name)
                   for role, count in self.counts.items() for name in (role if i == 0 else f"{role}-{i}" for i in range(count))]
        for service in started:
            self._wait_ready(service, timeout)

    def _start_scheduler(self, env: dict[str, str], timeout: float, name: str = "scheduler") -> Service:
        return self._wait_ready(self._launch("scheduler", {
            "TEMPER_SCHEDULER_DATABASE_URL": self.database_url, "TEMPER_SCHEDULER_INTERNAL_TOKEN": self.internal_token, **env},
            name=name), timeout)

    @property
    def scheduler_address(self) -> str:
        """The address clients use: the scheduler's, or every replica's, comma-separated (round_robin)."""
        return ",".join(s.address for s in self.services_of("scheduler"))

    def add_worker(self, role: str, timeout: float = 300.0) -> Service:
        """Start one more trainer or sampler that registers with the running scheduler (registration
        stacks); returns it once the scheduler knows it."""
        assert self.registration, "a worker added later reaches the scheduler by registering"
        name = f"{role}-{len(self.services_of(role))}"
        service = self._wait_ready(self._launch_worker(role, self._worker_env(role, name), name=name), timeout)
        self.wait_registered({role: len(self.services_of(role))}, timeout)
        return service

    def _launch_worker(self, role: str, env: dict[str, str], port: int = 0, name: str | None = None) -> Service:
        """One trainer or sampler; a trainer of ``trainer_world_size`` > 1 is a group of processes on a
        new rendezvous port: rank 0 (returned, the one with the gRPC port) and its followers."""
        if role != "trainer" or self.trainer_world_size == 1:
            return self._launch(role, env, port, name=name)
        name = name or role
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rendezvous = f"127.0.0.1:{s.getsockname()[1]}"
        group = {"TEMPER_TRAINER_WORLD_SIZE": str(self.trainer_world_size), "TEMPER_TRAINER_GROUP_ADDR": rendezvous}
        leader = self._launch(role, {**env, **group, "TEMPER_TRAINER_RANK": "0"}, port, name=name)
        leader.env = env  # without the group's rendezvous: restart_group makes a new one
        for rank in range(1, self.trainer_world_size):
            self._launch("trainer-rank", {**env, **group, "TEMPER_TRAINER_RANK": str(rank)},
                         argv=[sys.executable, "-m", MODULES["trainer"]], name=f"{name}.rank{rank}")
        return leader

    def group_ranks(self, name: str = "trainer") -> list[Service]:
        """The processes of trainer group ``name``, by rank (rank 0 is the service itself)."""
        return [self.service(name), *(s for s in self.services if s.name.startswith(f"{name}.rank"))]

    def restart_group(self, name: str = "trainer", crash: bool = False, timeout: float = 300.0) -> Service:
        """Stop every rank of trainer group ``name`` still running (SIGKILL when ``crash``, else SIGTERM)
        and start the group again on the same gRPC port (a new rendezvous). Returns the new rank 0."""
        ranks = self.group_ranks(name)
        for service in ranks:
            self.resume(service.name)
            if service.process.poll() is None:
                (service.process.kill if crash else service.process.terminate)()
        for service in ranks:
            service.process.wait(timeout=30)
            self.services.remove(service)
        leader = ranks[0]
        return self._wait_ready(self._launch_worker(leader.role, leader.env, leader.port, name=leader.name), timeout)

    def wait_registered(self, counts: dict[str, int], timeout: float = 300.0) -> None:
        """Until the scheduler knows at least ``counts`` workers of each role (its temper_scheduler_workers)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(self.service("scheduler").metrics_url, timeout=10) as page:
                text = page.read().decode()
            known = {role: 0.0 for role in counts}
            for line in text.splitlines():
                for role in counts:
                    if line.startswith(f'temper_scheduler_workers{{role="{role}"}} '):
                        known[role] = float(line.rsplit(" ", 1)[1])
            if all(known[role] >= n for role, n in counts.items()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler knows {known} workers, not {counts}, after {timeout:.0f} s")
            time.sleep(0.2)

    def _start_gateway(self, timeout: float) -> None:
        if self.gateway:
            self._wait_ready(self._launch("gateway", {"TEMPER_GATEWAY_SCHEDULER_ADDRESS": self.scheduler_address}), timeout)

    @property
    def gateway_url(self) -> str:
        """The Tinker gateway's base URL (TINKER_BASE_URL for the official SDK); needs ``gateway=True``."""
        return f"http://127.0.0.1:{self.service('gateway').port}"

    def key_for(self, tenant: str) -> str:
        """An API key of ``tenant`` on this stack's database (one per tenant and stack)."""
        if tenant not in self._keys:
            from temper.scheduler.admin import create_key

            self._keys[tenant] = create_key(self.database_url, tenant, label="localstack")
        return self._keys[tenant]

    def client(self, tenant: str = LOCAL_TENANT, **kwargs):
        """A ServiceClient of ``tenant`` on this stack (its key made on first use)."""
        from temper.client import ServiceClient

        return ServiceClient(self.scheduler_address, api_key=self.key_for(tenant), **kwargs)

    def restart(self, name: str, crash: bool = False, timeout: float = 300.0, argv: list[str] | None = None) -> Service:
        """Stop service ``name`` (SIGKILL when ``crash``, else SIGTERM) and start it again with the same
        settings and gRPC port, so the other services' addresses stay valid (``argv``: see _launch).
        Returns the new one."""
        old = self.service(name)
        self.resume(name)  # a stopped process would not act on SIGTERM
        (old.process.kill if crash else old.process.terminate)()
        old.process.wait(timeout=30)
        self.services.remove(old)
        return self._wait_ready(self._launch(old.role, old.env, old.port, argv, name=old.name), timeout)

    def restart_scheduler(self, crash: bool = True, timeout: float = 120.0) -> str:
        """Restart the scheduler on the same port, database and backends; returns its address."""
        return self.restart("scheduler", crash=crash, timeout=timeout).address

    def pause(self, name: str) -> None:
        """Freeze service ``name`` (SIGSTOP): its port stays open but nothing answers, like a hung host."""
        self.service(name).process.send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.service(name).process.send_signal(signal.SIGCONT)

    def service(self, name: str) -> Service:
        """By name: "scheduler", "trainer" (the first trainer), "trainer-1", "sampler", ..."""
        return next(s for s in self.services if s.name == name)

    def services_of(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]

    def stop(self) -> None:
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGCONT)
                service.process.terminate()
        for service in self.services:
            try:
                service.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                service.process.kill()
        self.services.clear()

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
