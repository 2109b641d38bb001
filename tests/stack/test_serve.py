"""`make serve` (python -m temper.serve) on the tiny model: it prints the addresses and a key, answers
over gRPC and HTTP with that key, and SIGTERM stops every process it started."""

import signal
import socket
import subprocess
import sys

import httpx
from serve_process import output_lines, ready_fields, serve_env

from temper.client import ServiceClient


def _closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_serve_prints_addresses_answers_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    env = serve_env(tiny_model_dir, tmp_path / "serve")
    process = subprocess.Popen([sys.executable, "-m", "temper.serve"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    try:
        ready = ready_fields(output_lines(process), timeout=300)
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
