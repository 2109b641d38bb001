"""Builds a grpc.aio server the same way for every Temper process: error interceptor (which also
counts failed calls: temper_rpc_errors_total), large message limits, the standard health service
and server reflection."""

from __future__ import annotations

import logging
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from temper.common.errors import Authenticator, ErrorInterceptor
from temper.common.metrics import count_rpc_error
from temper.common.server_options import CHANNEL_OPTIONS, SERVER_KEEPALIVE



def build_server(
    registrations: list[tuple[Callable[[object, grpc.aio.Server], None], object, str]],
    bind: str,
    authenticate: Authenticator | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Create a server with the given (add_fn, servicer, full_service_name) registrations.

    Returns the server, the bound port (useful with port 0) and the health servicer; callers mark
    themselves NOT_SERVING until ready (``mark_serving(..., serving=False)``). ``authenticate`` is
    awaited before every call (health and reflection included: it decides which methods are open).
    With ``credentials`` (``common.tls.server_credentials``) the port serves TLS only.
    """
    server = grpc.aio.server(interceptors=[ErrorInterceptor(authenticate, count_rpc_error)], options=[*CHANNEL_OPTIONS, *SERVER_KEEPALIVE])
    names = []
    for add_fn, servicer, name in registrations:
        add_fn(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(bind, credentials) if credentials is not None else server.add_insecure_port(bind)
    if port == 0:
        raise RuntimeError(f"could not bind {bind}")
    return server, port, health_servicer


async def mark_serving(health_servicer, service_names: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def configure_logging(level: str, fmt: str = "text") -> None:
    from temper.common.logs import configure_logging as configure

    configure(level, fmt)
