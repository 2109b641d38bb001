"""A worker that registers with several scheduler replicas (register_with "a,b"; common/registration.py):
one registration and heartbeat loop per registry, independent of each other. Two stand-in registries on
loopback: one that is down from the start delays nothing at the other; it is registered with once it
comes up; and when the first goes down, heartbeats to the second go on."""

from __future__ import annotations

import asyncio
import logging

from free_ports import free_port
from temper.common.errors import NotFound
from temper.common.internal_auth import token_authenticator
from temper.common.registration import registry_addresses, start_registration
from temper.common.server import build_server
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import registry_pb2, registry_pb2_grpc

TOKEN = "register-many-token"


class StandInRegistry(registry_pb2_grpc.RegistryServicer):
    """Knows the workers that registered with it; a heartbeat of any other answers NOT_FOUND."""

    def __init__(self):
        self.registrations: list[registry_pb2.RegisterRequest] = []
        self.heartbeats = 0
        self.known: set[tuple[str, str]] = set()

    async def Register(self, request, context):
        self.registrations.append(request)
        self.known.add((request.address, request.incarnation))
        return registry_pb2.RegisterResponse(heartbeat_timeout_seconds=10)

    async def Heartbeat(self, request, context):
        if (request.address, request.incarnation) not in self.known:
            raise NotFound("unknown worker")
        self.heartbeats += 1
        return registry_pb2.WorkerHeartbeatResponse()


async def serve(registry: StandInRegistry, port: int):
    server, bound, _ = build_server([(registry_pb2_grpc.add_RegistryServicer_to_server, registry, "temper.v1.Registry")],
                                    f"127.0.0.1:{port}", token_authenticator(TOKEN))
    await server.start()
    return server, bound


async def until(condition, what: str, tries: int = 400) -> None:
    """Polls ``condition`` every 50 ms; fails naming ``what`` when it never holds."""
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


def test_register_with_lists_one_address_or_several():
    assert registry_addresses("") == []
    assert registry_addresses("scheduler:50052") == ["scheduler:50052"]
    assert registry_addresses(" a:1, b:2 ,,a:1") == ["a:1", "b:2"]


def test_a_worker_registers_with_every_registry_and_one_down_stops_no_heartbeat_to_the_other(caplog):
    caplog.set_level(logging.INFO, logger="temper.common.registration")

    async def scenario():
        first, second = StandInRegistry(), StandInRegistry()
        first_server, first_port = await serve(first, 0)
        second_port = free_port()  # nothing listens there yet: that replica is down from the start
        settings = TrainerSettings(register_with=f"127.0.0.1:{first_port}, 127.0.0.1:{second_port}", heartbeat_seconds=0.05,
                                   internal_token=TOKEN)
        task = start_registration(settings, "trainer", "TEMPER_TRAINER_", 7, "m", 4, "inc-1")
        second_server = None
        try:
            await until(lambda: first.heartbeats >= 5, "heartbeats to the first registry while the second is down")
            assert len(first.registrations) == 1 and first.registrations[0].incarnation == "inc-1"

            second_server, _ = await serve(second, second_port)  # the second replica comes up: registered with too
            await until(lambda: second.heartbeats >= 3, "registration and heartbeats at the second registry")
            assert len(second.registrations) == 1 and second.registrations[0].address == first.registrations[0].address

            await first_server.stop(None)  # the first replica goes down: the second still gets heartbeats
            first_server = None
            before = second.heartbeats
            await until(lambda: second.heartbeats >= before + 10, "heartbeats to the second after the first went down")
            assert len(second.registrations) == 1  # not registered again: it never forgot the worker
            assert not task.done()
        finally:
            task.cancel()
            for server in (first_server, second_server):
                if server is not None:
                    await server.stop(None)
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    messages = [record.getMessage() for record in caplog.records]
    assert any("registers with 2 schedulers" in m for m in messages)
    assert sum(" registered with 127.0.0.1:" in m for m in messages) == 2  # once at each registry
    assert any("heartbeat to 127.0.0.1:" in m and "failed" in m for m in messages)  # the first, once it went down


def test_one_address_runs_one_registration_as_before(caplog):
    caplog.set_level(logging.INFO, logger="temper.common.registration")

    async def scenario():
        registry = StandInRegistry()
        server, port = await serve(registry, 0)
        settings = TrainerSettings(register_with=f"127.0.0.1:{port}", heartbeat_seconds=0.05, internal_token=TOKEN)
        task = start_registration(settings, "trainer", "TEMPER_TRAINER_", 7, "m", 4, "inc-1")
        try:
            await until(lambda: registry.heartbeats >= 2, "heartbeats to the one registry")
            assert task.get_name() == "register trainer" and len(registry.registrations) == 1
        finally:
            task.cancel()
            await server.stop(None)
        await asyncio.gather(task, return_exceptions=True)
        return port

    port = asyncio.run(scenario())
    messages = [record.getMessage() for record in caplog.records]
    assert not any("schedulers:" in m for m in messages)
    assert any(m.startswith("trainer ") and f"registered with 127.0.0.1:{port} (incarnation inc-1" in m for m in messages)
