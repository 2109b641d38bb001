"""`make serve` (python -m temper.serve) as a test runs it: a subprocess on free ports and a data folder of
the test's, ready when it prints its TEMPER_SERVE_READY line (the addresses and a key)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def output_lines(process: subprocess.Popen) -> "queue.Queue[str]":
    """The process's stdout lines as they come ("" at its end)."""
    lines: queue.Queue[str] = queue.Queue()

    def pump():
        for line in process.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    return lines


def ready_fields(lines: "queue.Queue[str]", timeout: float) -> dict[str, str]:
    """The key=value fields of the READY line (AssertionError with the output if it never comes)."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        seen.append(line)
        if line == "":
            break
        if line.startswith("TEMPER_SERVE_READY "):
            return dict(pair.split("=", 1) for pair in line.split()[1:])
    raise AssertionError(f"temper.serve did not get ready:\n{''.join(seen)[-3000:]}")


def serve_env(base_model: str, data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TEMPER_SCHEDULER_DATABASE_URL"}  # the default: SQLite
    env.update(TEMPER_SERVE_BASE_MODEL=base_model, TEMPER_SERVE_HTTP_PORT="0", TEMPER_SERVE_GRPC_PORT="0",
               TEMPER_SERVE_DATA_DIR=str(data_dir), TEMPER_SERVE_THREADS="1", PYTHONUNBUFFERED="1")
    return env


class ServeProcess:
    """``with ServeProcess(model, folder) as served``: served.http, .grpc, .api_key, .console, .process."""

    def __init__(self, base_model: str, data_dir: Path, timeout: float = 300):
        self.base_model, self.data_dir, self.timeout = base_model, Path(data_dir), timeout

    def __enter__(self) -> "ServeProcess":
        self.process = subprocess.Popen([sys.executable, "-m", "temper.serve"], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=serve_env(self.base_model, self.data_dir))
        try:
            ready = ready_fields(output_lines(self.process), self.timeout)
        except BaseException:
            self.process.kill()
            raise
        self.http, self.grpc, self.api_key, self.console = ready["http"], ready["grpc"], ready["api_key"], ready["console"]
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
