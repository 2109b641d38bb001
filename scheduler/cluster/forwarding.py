"""Forwarding a lane's verb to the replica that owns the lane (docs/replicas.md argues forwarding
over redirecting: the unmodified Tinker SDK, the gateway and raw gRPC clients know nothing of
replicas, and gRPC has no redirect; a forward costs one more unary hop on the scheduler side).

The forwarded call carries the caller's own metadata (its API key: the owner authenticates and
authorizes it again) and ``temper-forwarded-from``: a replica never forwards a forwarded call again,
so ownership that changed hands meanwhile ends in UNAVAILABLE (the client resends), never a loop.
The owner's answer, or its error with its code and message, is the caller's.
"""

from __future__ import annotations

import grpc

from temper.common.errors import TemperError, Unavailable
from temper.common.server_options import CHANNEL_OPTIONS
from temper.scheduler import metrics
from temper.scheduler.workers.downstream import downstream
from temper.v1 import service_pb2_grpc

FORWARDED_FROM = "temper-forwarded-from"
# metadata a hop must not copy: gRPC's own (pseudo-headers, grpc-*) and the transport's
_NOT_COPIED = ("grpc-", ":", "user-agent", "content-type", "te", "host")
FORWARD_KEEPALIVE = [("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000),
                     ("grpc.http2.max_pings_without_data", 0)]


class Forwarder:
    def __init__(self, owner: str):
        self.owner = owner
        self._stubs: dict[str, service_pb2_grpc.TemperStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self.forwarded = 0

    def _stub(self, address: str) -> service_pb2_grpc.TemperStub:
        stub = self._stubs.get(address)
        if stub is None:
            # a frozen owner (SIGSTOP) answers no ping: the forwarded call fails UNAVAILABLE within a few
            # seconds and the client resends it, by then to the lane's next owner
            channel = grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *FORWARD_KEEPALIVE])
            self._channels.append(channel)
            stub = self._stubs[address] = service_pb2_grpc.TemperStub(channel)
        return stub

    async def forward(self, address: str, method: str, request, context: grpc.aio.ServicerContext):
        """The answer of ``method`` at the replica at ``address``, called with this call's metadata."""
        metadata = [(key, value) for key, value in (context.invocation_metadata() or ())
                    if not key.startswith(_NOT_COPIED) and key != FORWARDED_FROM]
        metadata.append((FORWARDED_FROM, self.owner))
        remaining = context.time_remaining()
        self.forwarded += 1
        code = "OK"
        try:
            async with downstream(f"scheduler replica {address} (owner of the run's lane)"):
                return await getattr(self._stub(address), method)(request, metadata=metadata, timeout=remaining)
        except TemperError as exc:
            code = exc.code.name
            raise
        finally:
            metrics.FORWARDED.labels(method, code).inc()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def forwarded_from(context: grpc.aio.ServicerContext) -> str | None:
    """The replica that forwarded this call, or None (it came from a client)."""
    return next((value for key, value in (context.invocation_metadata() or ()) if key == FORWARDED_FROM), None)


def not_forwarded_twice(lane: str, sender: str) -> Unavailable:
    return Unavailable(f"replica {sender} forwarded this call here, but this replica does not hold the lane of trainer "
                       f"{lane} either (it changed hands); resend")
