"""The worker's side of registration (common/registration.py) and the scheduler's registry port
(scheduler/workers/registry.py), in-process on loopback: a worker keeps trying until the registry answers,
registers again when a heartbeat answers NOT_FOUND (the scheduler restarted), advertises the address
the scheduler can dial; the registry admits the internal token only."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from temper.common.errors import NotFound, Unavailable
from temper.common.internal_auth import InternalAuthConfigError, token_authenticator, with_token
from temper.common.registration import Registration, advertised_address
from temper.common.server import build_server
from temper.scheduler.workers.backends import Backends
from temper.scheduler.workers.membership import Membership
from temper.scheduler.workers.registry import start_registry
from temper.scheduler.settings import SchedulerSettings
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import registry_pb2, registry_pb2_grpc

TOKEN = "registry-test-token"


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    """Refuses the first registration (the scheduler is not there yet); forgets the worker once."""

    def __init__(self):
        self.registrations: list[registry_pb2.RegisterRequest] = []
        self.heartbeats = 0
        self.forget_at = 3  # the third heartbeat answers NOT_FOUND, as a restarted scheduler does
        self.refused = 0

    async def Register(self, request, context):
        if self.refused == 0:
            self.refused += 1
            raise Unavailable("starting")
        self.registrations.append(request)
        return registry_pb2.RegisterResponse(heartbeat_timeout_seconds=10)

    async def Heartbeat(self, request, context):
        self.heartbeats += 1
        if self.heartbeats == self.forget_at:
            raise NotFound("register again")
        return registry_pb2.WorkerHeartbeatResponse()


def test_a_worker_retries_registers_heartbeats_and_registers_again_when_forgotten():
    async def scenario():
        fake = FakeRegistry()
        server, port, _ = build_server([(registry_pb2_grpc.add_RegistryServicer_to_server, fake, "temper.v1.Registry")],
                                       "127.0.0.1:0", token_authenticator(TOKEN))
        await server.start()
        settings = TrainerSettings(register_with=f"127.0.0.1:{port}", heartbeat_seconds=0.05, internal_token=TOKEN)
        registration = Registration(settings, "trainer", "TEMPER_TRAINER_", "127.0.0.1:7", "m", 4, "inc-1")
        task = asyncio.create_task(registration.run_forever())
        try:
            for _ in range(200):
                if len(fake.registrations) >= 2 and fake.heartbeats >= 4:
                    break
                await asyncio.sleep(0.05)
            assert fake.refused == 1 and len(fake.registrations) == 2 and fake.heartbeats >= 4
            first = fake.registrations[0]
            assert (first.role, first.address, first.base_model, first.capacity, first.incarnation) == (
                registry_pb2.WORKER_ROLE_TRAINER, "127.0.0.1:7", "m", 4, "inc-1")
        finally:
            task.cancel()
            await server.stop(None)

    asyncio.run(scenario())


def test_the_advertised_address_is_one_the_scheduler_can_dial():
    def settings(**kw):
        return TrainerSettings(internal_auth="disabled", **kw)

    assert advertised_address(settings(bind="127.0.0.1:0"), 4321) == "127.0.0.1:4321"
    assert advertised_address(settings(bind="0.0.0.0:50061"), 50061) == f"{socket.gethostname()}:50061"
    assert advertised_address(settings(bind="[::]:50061"), 50061) == f"{socket.gethostname()}:50061"
    assert advertised_address(settings(bind="0.0.0.0:0", advertise_address="trainer-3:9"), 123) == "trainer-3:9"


def test_the_registry_admits_the_internal_token_only():
    async def scenario():
        settings = SchedulerSettings(database_url="sqlite://", registry_bind="127.0.0.1:0", internal_token=TOKEN)
        membership = Membership(Backends(settings), None, settings)
        server, port = await start_registry(settings, membership)
        beat = registry_pb2.WorkerHeartbeatRequest(role=registry_pb2.WORKER_ROLE_TRAINER, address="t:1", incarnation="a")
        try:
            for token in (None, "wrong", "tml-an-api-key"):
                async with with_token(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), token) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await registry_pb2_grpc.RegistryStub(channel).Heartbeat(beat, timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with with_token(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), TOKEN) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await registry_pb2_grpc.RegistryStub(channel).Heartbeat(beat, timeout=5)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND  # admitted; this scheduler does not know it
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    with pytest.raises(InternalAuthConfigError, match="INTERNAL_TOKEN"):
        settings = SchedulerSettings(database_url="sqlite://", registry_bind="127.0.0.1:0")
        asyncio.run(start_registry(settings, Membership(Backends(settings), None, settings)))
