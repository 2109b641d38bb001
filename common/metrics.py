"""Prometheus metrics endpoint shared by every Temper process, and the one series they all share
(failed RPCs). Each process defines its own series with prometheus_client (module-level, on the
default registry) and calls ``serve_metrics`` once."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import Counter

log = logging.getLogger(__name__)

# Counted by the one error interceptor of every gRPC server (common/server.build_server), never by a
# servicer: each service's failures the same way, once per failed call.
RPC_ERRORS = Counter("temper_rpc_errors_total", "Failed calls to this process's gRPC services, by service, method and "
                     "the status code sent.", ["service", "method", "code"])


def count_rpc_error(method: str, code: grpc.StatusCode) -> None:
    """``method`` is gRPC's full name, ``/package.Service/Method``."""
    service, _, name = method.lstrip("/").rpartition("/")
    RPC_ERRORS.labels(service, name, code.name).inc()


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
