"""The scheduler's internal registry port (``registry_bind``): trainers and samplers register and
send heartbeats there (``common/registration.py``), and ``membership.py`` acts on it.

It is a separate port from the public API because its callers are workers, not tenants: calls carry
the internal token (the same secret the scheduler presents to the workers), never an API key, and
it can sit on the internal network only. Optional TLS / mutual TLS: registry_tls_*."""

from __future__ import annotations

import grpc

from temper.common.internal_auth import InternalAuthConfigError, resolve_token, token_authenticator
from temper.common.server import build_server, mark_serving
from temper.common.tls import server_credentials
from temper.scheduler.workers.membership import Membership
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import registry_pb2, registry_pb2_grpc

SERVICE = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, membership: Membership):
        self.membership = membership

    async def Register(self, request, context):
        await self.membership.register(request.role, request.address, request.incarnation)
        return registry_pb2.RegisterResponse(heartbeat_timeout_seconds=self.membership.settings.worker_timeout_seconds)

    async def Heartbeat(self, request, context):
        self.membership.heartbeat(request.role, request.address, request.incarnation)
        return registry_pb2.WorkerHeartbeatResponse()


async def start_registry(settings: SchedulerSettings, membership: Membership) -> tuple[grpc.aio.Server, int]:
    """Serve the registry on registry_bind; the server and its bound port. Without an internal token
    there is nothing to check a worker by: refused (InternalAuthConfigError)."""
    token = resolve_token(settings, "TEMPER_SCHEDULER_")
    if token is None:
        raise InternalAuthConfigError("TEMPER_SCHEDULER_REGISTRY_BIND needs TEMPER_SCHEDULER_INTERNAL_TOKEN (or _FILE): "
                                      "workers register with that token")
    credentials = server_credentials(settings.registry_tls_cert_file, settings.registry_tls_key_file,
                                     settings.registry_tls_client_ca_file)
    registration = (registry_pb2_grpc.add_RegistryServicer_to_server, RegistryServicer(membership), SERVICE)
    server, port, health = build_server([registration], settings.registry_bind, token_authenticator(token), credentials)
    await server.start()
    await mark_serving(health, [SERVICE])
    return server, port
