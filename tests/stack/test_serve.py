"""`make serve` (python -m temper.serve) on the tiny model: it prints the addresses and a key, answers
over gRPC and HTTP with that key, and SIGTERM stops every process it started."""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from temper.client import ServiceClient


def _lines(process: subprocess.Popen) -> "queue.Queue[str]":
    lines: queue.Queue[str] = queue.Queue()

    def pump():
        for line in process.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _ready(lines: "queue.Queue[str]", timeout: float) -> dict[str, str]:
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


def _closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_serve_prints_addresses_answers_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TEMPER_SCHEDULER_DATABASE_URL"}  # the default: SQLite
    env.update(TEMPER_SERVE_BASE_MODEL=tiny_model_dir, TEMPER_SERVE_HTTP_PORT="0", TEMPER_SERVE_GRPC_PORT="0",
               TEMPER_SERVE_DATA_DIR=str(tmp_path / "serve"), TEMPER_SERVE_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "temper.serve"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    try:
        ready = _ready(_lines(process), timeout=300)
        assert ready["api_key"].startswith("tml-") and ready["http"].startswith("http://127.0.0.1:")
        assert (tmp_path / "serve" / "temper.db").exists()
        with ServiceClient(ready["grpc"], api_key=ready["api_key"]) as client:
            assert tiny_model_dir in [m.model_name for m in client.get_server_capabilities().supported_models]
        resp = httpx.post(f"{ready['http']}/v1/completions", headers={"Authorization": f"Bearer {ready['api_key']}"},
                          json={"model": tiny_model_dir, "prompt": "The capital of France is", "max_tokens": 3, "seed": 0},
                          timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
        assert ready["console"] == f"{ready['http']}/console/"  # the console's URL, printed for a person too
        page = httpx.get(ready["console"], timeout=30)
        assert page.status_code == 200 and "Temper console" in page.text
        ports = [int(ready["grpc"].rsplit(":", 1)[1]), int(ready["http"].rsplit(":", 1)[1])]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        assert all(_closed(port) for port in ports), "a process of the stack outlived temper.serve"
    finally:
        if process.poll() is None:
            process.kill()
