"""Start scheduler, trainer and sampler as separate local processes on loopback ports.

Used by `make demo` and the integration tests. Each service binds port 0 and prints
"TEMPER_READY <role> port=<n>"; we read that line instead of guessing free ports.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

READY_PREFIX = "TEMPER_READY "


@dataclass
class Service:
    role: str
    process: subprocess.Popen
    log_path: Path
    port: int = 0
    lines: "queue.Queue[str]" = field(default_factory=queue.Queue)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _pump(service: Service, log) -> None:
    for line in service.process.stdout:
        log.write(line)
        log.flush()
        if line.startswith(READY_PREFIX):
            service.lines.put(line)
    service.lines.put("")


class LocalStack:
    def __init__(self, base_model: str, data_dir: Path, database_url: str | None = None, extra_env: dict[str, str] | None = None,
                 num_threads: int = 0):
        self.base_model = base_model
        self.data_dir = Path(data_dir)
        self.database_url = database_url or f"sqlite:///{self.data_dir / 'temper.db'}"
        self.extra_env = extra_env or {}
        self.num_threads = num_threads
        self.services: list[Service] = []

    def _start(self, role: str, module: str, env: dict[str, str]) -> Service:
        log_path = self.data_dir / "logs" / f"{role}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env, **self.extra_env}
        process = subprocess.Popen(
            [sys.executable, "-m", module], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        service = Service(role, process, log_path)
        threading.Thread(target=_pump, args=(service, open(log_path, "a")), daemon=True).start()
        self.services.append(service)
        return service

    @staticmethod
    def _wait_ready(service: Service, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = service.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line:
                service.port = int(line.rsplit("port=", 1)[1])
                return
            if line == "" or service.process.poll() is not None or time.monotonic() > deadline:
                tail = service.log_path.read_text()[-3000:] if service.log_path.exists() else ""
                raise RuntimeError(f"{service.role} did not start (see {service.log_path}):\n{tail}")

    def start(self, timeout: float = 300.0) -> str:
        """Start all three services; returns the scheduler's address."""
        threads = {"TEMPER_TRAINER_NUM_THREADS": str(self.num_threads), "TEMPER_SAMPLER_NUM_THREADS": str(self.num_threads)}
        trainer = self._start("trainer", "temper.services.trainer", {
            "TEMPER_TRAINER_BASE_MODEL": self.base_model, "TEMPER_TRAINER_BIND": "127.0.0.1:0",
            "TEMPER_TRAINER_CHECKPOINT_DIR": str(self.data_dir / "checkpoints"), **threads,
        })
        sampler = self._start("sampler", "temper.services.sampler", {
            "TEMPER_SAMPLER_BASE_MODEL": self.base_model, "TEMPER_SAMPLER_BIND": "127.0.0.1:0",
            "TEMPER_SAMPLER_ADAPTER_DIR": str(self.data_dir / "sampler-adapters"), **threads,
        })
        try:
            self._wait_ready(trainer, timeout)
            self._wait_ready(sampler, timeout)
            scheduler = self._start_scheduler(0, timeout)
        except BaseException:
            self.stop()
            raise
        return scheduler.address

    def _start_scheduler(self, port: int, timeout: float) -> Service:
        scheduler = self._start("scheduler", "temper.scheduler", {
            "TEMPER_BIND": f"127.0.0.1:{port}", "TEMPER_DATABASE_URL": self.database_url,
            "TEMPER_TRAINER_ADDRESSES": self.service("trainer").address, "TEMPER_SAMPLER_ADDRESSES": self.service("sampler").address,
        })
        self._wait_ready(scheduler, timeout)
        return scheduler

    def restart_scheduler(self, crash: bool = True, timeout: float = 120.0) -> str:
        """Stop the scheduler (SIGKILL when ``crash``, else SIGTERM) and start a new one on the same
        port, database and backends; the trainer and sampler keep running. Returns its address."""
        old = self.service("scheduler")
        (old.process.kill if crash else old.process.terminate)()
        old.process.wait(timeout=30)
        self.services.remove(old)
        return self._start_scheduler(old.port, timeout).address

    def service(self, role: str) -> Service:
        return next(s for s in self.services if s.role == role)

    def stop(self) -> None:
        for service in reversed(self.services):
            if service.process.poll() is None:
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
