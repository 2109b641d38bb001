"""Prometheus metrics endpoint shared by every Temper process. Each process defines its own series
with prometheus_client (module-level, on the default registry) and calls ``serve_metrics`` once."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def serve_metrics(bind: str) -> int | None:
    """Serve /metrics of the default registry on ``host:port`` in a daemon thread. Returns the bound
    port (useful with port 0), or None when ``bind`` is empty (no endpoint)."""
    if not bind:
        return None
    from prometheus_client import start_http_server

    host, _, port = bind.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host or "0.0.0.0")
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", bound)
    return bound


def ready_line(role: str, port: int, metrics_port: int | None) -> str:
    """The line a process prints once it serves: LocalStack and tests read the ports from it."""
    line = f"TEMPER_READY {role} port={port}"
    return line + (f" metrics_port={metrics_port}" if metrics_port is not None else "")
