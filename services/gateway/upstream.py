"""The gateway's one channel to the scheduler's public API, and the calls it makes on a caller's behalf.

Every call carries the caller's own API key as ``authorization: Bearer <key>``: the scheduler checks
it and takes the tenant from it, so the gateway never decides who anyone is. With several replicas,
a run's lane verbs go to the replica its last answer named as the lane's owner (common/owner_hints.py),
so they are not forwarded between replicas; a hint that fails is dropped and the call resent.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import grpc

from temper.common.channel_target import channel_target
from temper.common.owner_hints import LANE_VERBS, OwnerRouting, hint_options
from temper.common.retry import retry
from temper.common.tls import channel_credentials
from temper.services.gateway.errors import GatewayError
from temper.v1 import service_pb2_grpc


class Scheduler:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None, timeout: float = 60.0,
                 unavailable_seconds: float = 120.0):
        """``address``: one host:port, or several replicas as host1:port1,host2:port2 or dns:///name:port
        (round_robin: common/channel_target.py); ``timeout``: deadline of the calls that answer at once (sessions, info, listings);
        ``unavailable_seconds``: how long a verb is resent while the scheduler is unreachable."""
        self.address = address
        self._target, self._options = channel_target(address)  # a malformed address fails at startup
        self.timeout = timeout
        self.unavailable_seconds = unavailable_seconds
        self._credentials = credentials
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.TemperStub | None = None
        self._owners: OwnerRouting | None = None  # several replicas: owner hints (made with the channel)

    @classmethod
    def from_settings(cls, settings) -> "Scheduler":
        credentials = None
        if settings.scheduler_tls_ca_file or settings.scheduler_tls:
            credentials = channel_credentials(settings.scheduler_tls_ca_file, settings.scheduler_tls_client_cert_file,
                                              settings.scheduler_tls_client_key_file)
        return cls(settings.scheduler_address, credentials, settings.rpc_timeout_seconds, settings.unavailable_retry_seconds)

    @property
    def stub(self) -> service_pb2_grpc.TemperStub:
        # made on first use, inside the server's event loop (a grpc.aio channel belongs to one loop)
        if self._stub is None:
            if self._credentials is None:
                self._channel = grpc.aio.insecure_channel(self._target, options=self._options)
            else:
                self._channel = grpc.aio.secure_channel(self._target, self._credentials, options=self._options)
            self._stub = service_pb2_grpc.TemperStub(self._channel)
            options = hint_options(self._options)
            if len(options) < len(self._options):  # round_robin: several replicas
                self._owners = OwnerRouting(self._replica_channel(options), service_pb2_grpc.TemperStub)
        return self._stub

    def _replica_channel(self, options):
        """Opens a channel to one replica (an owner hint's address), as the main channel is opened."""
        if self._credentials is None:
            return lambda address: grpc.aio.insecure_channel(address, options=options)
        return lambda address: grpc.aio.secure_channel(address, self._credentials, options=options)

    def _send(self, method: str, request: Any, key: str | None, **kwargs):
        """The call (an awaitable): a lane verb through its run's owner hint when there are replicas."""
        stub = self.stub
        if self._owners is not None and method in LANE_VERBS:
            return self._owners.call(stub, method, request, metadata=_metadata(key), **kwargs)
        return getattr(stub, method)(request, metadata=_metadata(key), **kwargs)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
        if self._owners is not None:
            await self._owners.close()
            self._owners = None

    async def call(self, method: str, request: Any, key: str | None) -> Any:
        """One call with the caller's key; a failed call raises GatewayError. Answers at once or fails
        (an unreachable scheduler is UNAVAILABLE now, which the SDK resends)."""
        try:
            return await self._send(method, request, key, timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            raise GatewayError.of(err) from None

    async def verb(self, method: str, request: Any, key: str | None) -> Any:
        """A verb behind a future: waits in the scheduler's queues for as long as they take, and is
        resent on backpressure (for as long as it lasts, as temper.client does) and while the
        scheduler is unreachable (``unavailable_seconds``). Resending is safe: the scheduler answers a
        repeated (run, seq) with the first answer."""
        async def once():
            try:
                # not wait_for_ready: an unreachable scheduler must surface (and be bounded) here, not hang
                return await self._send(method, request, key)
            except grpc.aio.AioRpcError as err:
                raise GatewayError.of(err) from None

        # Backpressure is resent for as long as it lasts; unreachability for unavailable_seconds from
        # its first failure (a verb may rightly wait long in the queues before the scheduler goes), and
        # an answer of backpressure in between starts that window again.
        async def while_reachable():
            return await retry(once, seconds=self.unavailable_seconds, retryable=_unreachable, from_first_failure=True,
                               first_delay=0.05, max_delay=2.0, jitter=1.0)

        return await retry(while_reachable, seconds=None, retryable=_backpressure, first_delay=0.05, max_delay=2.0, jitter=1.0)

    async def open_stream(self, method: str, request: Any, key: str | None) -> AsyncIterator[Any]:
        """A server-streaming verb (SampleStream), opened as ``verb`` sends a verb: resent on
        backpressure and while unreachable, but only until its first message has come, which is
        awaited here (so a refused request raises GatewayError now, before any answer is started).
        Returns the messages, the first included; closing the iterator cancels the call."""
        async def once():
            call = getattr(self.stub, method)(request, metadata=_metadata(key))
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as err:
                raise GatewayError.of(err) from None
            if first is grpc.aio.EOF:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"{method} ended before its first message")
            return call, first

        async def while_reachable():
            return await retry(once, seconds=self.unavailable_seconds, retryable=_unreachable, from_first_failure=True,
                               first_delay=0.05, max_delay=2.0, jitter=1.0)

        call, first = await retry(while_reachable, seconds=None, retryable=_backpressure, first_delay=0.05, max_delay=2.0,
                                  jitter=1.0)
        return _messages(call, first)

    async def upload(self, method: str, messages: list, key: str | None) -> Any:
        """A client-streaming call (UploadImage): ``messages`` sent in order, one answer; answers at once
        or fails, as ``call``."""
        try:
            return await getattr(self.stub, method)(iter(messages), metadata=_metadata(key), timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            raise GatewayError.of(err) from None

    async def stream(self, method: str, request: Any, key: str | None) -> list:
        try:
            return [item async for item in getattr(self.stub, method)(request, metadata=_metadata(key), timeout=self.timeout)]
        except grpc.aio.AioRpcError as err:
            raise GatewayError.of(err) from None


async def _messages(call, first) -> AsyncIterator[Any]:
    try:
        message = first
        while message is not grpc.aio.EOF:
            yield message
            try:
                message = await call.read()
            except grpc.aio.AioRpcError as err:
                raise GatewayError.of(err) from None
    finally:
        call.cancel()


def _unreachable(exc: BaseException) -> bool:
    return isinstance(exc, GatewayError) and exc.code == grpc.StatusCode.UNAVAILABLE


def _backpressure(exc: BaseException) -> bool:
    return isinstance(exc, GatewayError) and exc.transient and exc.code != grpc.StatusCode.UNAVAILABLE


def _metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()
