"""The client's background event loop and gRPC channel, shared by every client object of one
ServiceClient. Calls are scheduled from any thread and retried on transient statuses."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from typing import Any, Awaitable, Callable

import grpc

from temper.common.errors import from_rpc_error, is_hard_limit
from temper.common.server_options import CHANNEL_OPTIONS
from temper.common.tls import channel_credentials
from temper.v1 import service_pb2_grpc

# Safe to resend: training verbs carry a (run, seq) the scheduler deduplicates; the rest are reads
# or creations that fail before anything is recorded.
RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


def resolve_target(base_url: str, root_certificates: bytes | None = None) -> tuple[str, grpc.ChannelCredentials | None]:
    """(host:port, TLS credentials or None) of a base URL. ``grpcs://host:port`` is TLS, checked against
    ``root_certificates``, else the PEM file TEMPER_TLS_CA_FILE names, else the system's roots;
    ``grpc://host:port`` is plaintext; a bare ``host:port`` is TLS when a CA is given that way.
    TEMPER_TLS_CLIENT_CERT_FILE and TEMPER_TLS_CLIENT_KEY_FILE add a client certificate (mutual TLS)."""
    scheme, sep, target = base_url.partition("://")
    if not sep:
        scheme, target = "", base_url
    if scheme not in ("", "grpc", "grpcs"):
        raise ValueError(f"base URL {base_url!r}: the scheme is grpc:// (plaintext) or grpcs:// (TLS)")
    ca_file = os.environ.get("TEMPER_TLS_CA_FILE") or None
    if scheme == "grpc":
        if root_certificates is not None:
            raise ValueError(f"base URL {base_url!r} is plaintext; use grpcs:// with root_certificates")
        return target, None
    if scheme == "" and root_certificates is None and ca_file is None:
        return target, None
    credentials = channel_credentials(ca_file, os.environ.get("TEMPER_TLS_CLIENT_CERT_FILE") or None,
                                      os.environ.get("TEMPER_TLS_CLIENT_KEY_FILE") or None, root_certificates=root_certificates)
    return target, credentials


class Runtime:
    def __init__(self, target: str, metadata: list[tuple[str, str]], max_retries: int = 8, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        """``target``: host:port; ``credentials``: TLS (``resolve_target``), None for plaintext."""
        self.metadata = metadata
        self.credentials = credentials
        self.max_retries = max_retries
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="temper-client", daemon=True)
        self._thread.start()
        self.stub: service_pb2_grpc.TemperStub = self.call_soon(self._connect(target)).result()

    async def _connect(self, target: str):
        if self.credentials is None:
            self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.secure_channel(target, self.credentials, options=CHANNEL_OPTIONS)
        return service_pb2_grpc.TemperStub(self.channel)

    def call_soon(self, coro: Awaitable[Any]):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def rpc(self, method: str, request: Any):
        """Schedule a unary call with retries; returns a concurrent.futures.Future."""
        return self.call_soon(self._call(method, request))

    async def _call(self, method: str, request: Any):
        fn: Callable = getattr(self.stub, method)
        delay, failures = 0.05, 0
        while True:
            try:
                return await fn(request, metadata=self.metadata, timeout=self.timeout, wait_for_ready=True)
            except grpc.aio.AioRpcError as err:
                # A full queue is backpressure, not failure (as Tinker treats HTTP 429): wait and
                # resend for as long as it takes. Unavailability is retried a bounded number of times.
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    failures += 1
                if err.code() not in RETRY_CODES or failures > self.max_retries or is_hard_limit(err.code(), err.details()):
                    raise from_rpc_error(err) from None
            await asyncio.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 2.0)

    def stream(self, method: str, request: Any):
        async def collect():
            try:
                return [chunk async for chunk in getattr(self.stub, method)(request, metadata=self.metadata)]
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err) from None

        return self.call_soon(collect())

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.call_soon(self.channel.close()).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()
