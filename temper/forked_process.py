"""LocalStack's side of temper/forkserver.py: one fork server per test process, and a handle for each service it
forks that answers as the ``subprocess.Popen`` of a ``python -m`` service would (pid, poll, wait, signals,
returncode), so tests, restarts and fault injection treat both alike."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from temper.common.host_allocator import TUNED_MALLOC_ENV, is_glibc_linux, tuned_environ

ENABLE_ENV = "TEMPER_LOCALSTACK_FORKSERVER"


def forkserver_wanted() -> bool:
    return os.environ.get(ENABLE_ENV, "").lower() in ("1", "true", "yes")


def can_fork_into(env: dict[str, str]) -> bool:
    """Whether a child of the (tuned-allocator) fork server matches what ``python -m`` would run under
    ``env``: not when the service turns the allocator tuning off or sets malloc variables of its own."""
    if any(k.endswith("_TUNE_HOST_ALLOCATOR") and v.lower() in ("0", "false", "no") for k, v in env.items()):
        return False
    return all(env.get(k, v) == v for k, v in TUNED_MALLOC_ENV.items())


def as_reexecuted(env: dict[str, str]) -> dict[str, str]:
    """``env`` as a service's allocator re-exec leaves it (common/host_allocator.py), for the fork server
    and its children, which run under that allocator without re-executing."""
    return (tuned_environ(env) or dict(env)) if is_glibc_linux() else dict(env)


class ForkedProcess:
    """A service forked by the fork server: the Popen calls LocalStack and the tests use."""

    def __init__(self, pid: int, exit_path: Path, args: list[str]):
        self.pid, self.exit_path, self.args = pid, exit_path, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.exit_path.exists():
            self.returncode = int(self.exit_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """``python -m temper.forkserver``, started on first use and shared by every stack of this process
    (``shared()``); stopped when this process exits, which stops any service it forked still running."""

    _shared: "ForkServer | None" = None

    @classmethod
    def shared(cls) -> "ForkServer":
        if cls._shared is None:
            import tempfile

            cls._shared = cls(Path(tempfile.mkdtemp(prefix="temper-forkserver-")))
            atexit.register(cls._shared.stop)
        return cls._shared

    def __init__(self, folder: Path):
        self.folder = folder
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = as_reexecuted(dict(os.environ))
        log = open(self.folder / "forkserver.log", "a")
        process = subprocess.Popen([sys.executable, "-m", "temper.forkserver"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.close()
        if not process.stdout.readline():
            raise RuntimeError(f"the fork server did not start (see {self.folder / 'forkserver.log'})")
        return process

    def spawn(self, module: str, env: dict[str, str], log_path: Path) -> ForkedProcess:
        exit_path = log_path.with_name(f"{log_path.name}.{secrets.token_hex(4)}.exit")
        child_env = as_reexecuted(env)
        with self.lock:
            if self.process is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.process = self._start()
            self.process.stdin.write(json.dumps({"module": module, "env": child_env, "cwd": os.getcwd(), "log": str(log_path),
                                                 "exit": str(exit_path)}) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server stopped (see {self.folder / 'forkserver.log'})")
        return ForkedProcess(json.loads(reply)["pid"], exit_path, [sys.executable, "-m", module])

    def stop(self) -> None:
        with self.lock:
            if self.process is not None:
                self.process.stdin.close()  # it kills any child still running, then exits
                try:
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                self.process = None
