"""A trainer's or sampler's membership in the scheduler (``register_with``): once its server listens,
the worker registers at the scheduler's registry (scheduler/workers/registry.py) and sends a heartbeat every
``heartbeat_seconds``. It registers again whenever the scheduler does not know it (the heartbeat
answers NOT_FOUND: the scheduler restarted), and keeps trying, quietly, while the scheduler cannot
be reached: workers may start before the scheduler. Calls carry the worker's internal token.

Scheduler replicas (docs/replicas.md) each keep their own registry: ``register_with`` may list several,
comma-separated, and the worker runs one registration per address, each with its own channel and its
own retries, so a replica that is down delays no heartbeat to the others."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc

from temper.common.internal_auth import resolve_token, with_token
from temper.common.server_options import CHANNEL_OPTIONS
from temper.common.tls import channel_credentials
from temper.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)
ROLES = {"trainer": registry_pb2.WORKER_ROLE_TRAINER, "sampler": registry_pb2.WORKER_ROLE_SAMPLER}
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}
RETRY_MAX_SECONDS = 5.0
CALL_TIMEOUT_SECONDS = 30.0  # a registration waits for the scheduler to dial back (up to 10 s there)


def advertised_address(settings, port: int) -> str:
    """What the scheduler dials: advertise_address, else bind's host with the port actually bound (a
    wildcard bind advertises this machine's host name, which peers on its network resolve)."""
    if settings.advertise_address:
        return settings.advertise_address
    host = settings.bind.rsplit(":", 1)[0] if ":" in settings.bind else ""
    return f"{socket.gethostname() if host in WILDCARD_HOSTS else host}:{port}"


def registry_addresses(register_with: str) -> list[str]:
    """The registries of ``register_with``: one host:port, or several comma-separated (one per scheduler
    replica); blanks around commas and empty items are ignored, a repeated address counts once."""
    return list(dict.fromkeys(part.strip() for part in register_with.split(",") if part.strip()))


class Registration:
    """Register, then heartbeat until the scheduler forgets this worker; again, forever (a task).
    One registry: ``registry`` (default: register_with, a single address)."""

    def __init__(self, settings, role: str, prefix: str, address: str, base_model: str, capacity: int, incarnation: str,
                 registry: str | None = None):
        self.settings = settings
        self.registry = registry if registry is not None else settings.register_with
        self.request = registry_pb2.RegisterRequest(role=ROLES[role], address=address, base_model=base_model,
                                                    capacity=capacity, incarnation=incarnation)
        self.beat = registry_pb2.WorkerHeartbeatRequest(role=ROLES[role], address=address, incarnation=incarnation)
        self.what = f"{role} {address}"
        token = resolve_token(settings, prefix)
        if token is None:
            log.warning("no %sINTERNAL_TOKEN: the scheduler's registry will refuse this %s", prefix, role)
        self._token = token
        self.registered = asyncio.Event()  # set at each successful registration (tests wait on it)

    def _channel(self) -> grpc.aio.Channel:
        s = self.settings
        options = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000)]
        if s.register_tls_ca_file is None:
            return with_token(grpc.aio.insecure_channel(self.registry, options=options), self._token)
        credentials = channel_credentials(s.register_tls_ca_file, s.register_tls_cert_file, s.register_tls_key_file)
        return with_token(grpc.aio.secure_channel(self.registry, credentials, options=options), self._token)

    async def run_forever(self) -> None:
        async with self._channel() as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            while True:
                await self._register(stub)
                await self._heartbeats(stub)

    async def _register(self, stub: registry_pb2_grpc.RegistryStub) -> None:
        delay, failures = 0.2, 0
        while True:
            try:
                answer = await stub.Register(self.request, timeout=CALL_TIMEOUT_SECONDS)
            except grpc.aio.AioRpcError as err:
                failures += 1
                # the first failure and then every tenth: a scheduler that starts after its workers is normal
                if failures == 1 or failures % 10 == 0 or err.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                                          grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("%s could not register with %s (%s: %s); retrying", self.what, self.registry,
                                err.code().name, err.details())
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            log.info("%s registered with %s (incarnation %s; down after %.0f s without a heartbeat)", self.what,
                     self.registry, self.request.incarnation, answer.heartbeat_timeout_seconds)
            self.registered.set()
            return

    async def _heartbeats(self, stub: registry_pb2_grpc.RegistryStub) -> None:
        """Until the scheduler answers that it does not know this worker (then: register again)."""
        failing = False
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            try:
                await stub.Heartbeat(self.beat, timeout=max(self.settings.heartbeat_seconds, 1.0))
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("the scheduler at %s does not know %s (%s): registering again", self.registry,
                                self.what, err.details())
                    self.registered.clear()
                    return
                if not failing:
                    log.warning("heartbeat to %s failed (%s: %s); still trying", self.registry,
                                err.code().name, err.details())
                failing = True
                continue
            if failing:
                log.info("heartbeats to %s go through again", self.registry)
            failing = False


def start_registration(settings, role: str, prefix: str, port: int, base_model: str, capacity: int,
                       incarnation: str) -> asyncio.Task | None:
    """The registration task of a worker whose server listens on ``port``; None without register_with.
    Several registries: one task per registry under the returned one (cancelling it cancels them all)."""
    registries = registry_addresses(settings.register_with)
    if not registries:
        return None
    address = advertised_address(settings, port)
    registrations = [Registration(settings, role, prefix, address, base_model, capacity, incarnation, registry)
                     for registry in registries]
    if len(registrations) == 1:
        return asyncio.create_task(registrations[0].run_forever(), name=f"register {role}")
    log.info("%s %s registers with %d schedulers: %s", role, address, len(registrations), ", ".join(registries))
    tasks = [asyncio.create_task(r.run_forever(), name=f"register {role} with {r.registry}") for r in registrations]
    return asyncio.create_task(_all(tasks), name=f"register {role}")


async def _all(tasks: list[asyncio.Task]) -> None:
    """Waits on every registration. Each is its own task: one that failed (they retry, so: a bug) is
    logged, and the others go on heartbeating; cancelling this cancels them all."""
    for task in tasks:
        task.add_done_callback(_log_failure)
    try:
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s stopped", task.get_name(), exc_info=task.exception())
