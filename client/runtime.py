"""The client's background event loop and gRPC channel, shared by every client object of one
ServiceClient. Calls are scheduled from any thread and retried on transient statuses."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from typing import Any, Awaitable, Callable, Iterable

import grpc

from temper.client.errors import APIConnectionError, from_rpc_error
from temper.common.channel_target import MULTI_SCHEMES, channel_target
from temper.common.errors import is_hard_limit
from temper.common.owner_hints import LANE_VERBS, OwnerRouting, hint_options
from temper.common.seqs import settles
from temper.common.tls import channel_credentials
from temper.v1 import service_pb2, service_pb2_grpc

# Safe to resend: training verbs carry a (run, seq) the scheduler deduplicates; the rest are reads
# or creations that fail before anything is recorded.
RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
DEFAULT_BASE_URL = "127.0.0.1:50051"
DEFAULT_CONNECT_TIMEOUT = 30.0
GRPC_HINT = ("temper.client speaks gRPC to the Temper scheduler (host:port, grpc:// or grpcs://); the Tinker SDK's "
             "http(s):// URL is the HTTP gateway's")


def resolve_base_url(base_url: str | None) -> str:
    """``base_url``, else TEMPER_BASE_URL, else TEMPER_ADDRESS, else TINKER_BASE_URL when it is a gRPC
    address (a Tinker script's environment), else the local default. An http(s):// TINKER_BASE_URL
    points the official SDK at the gateway: it is not ours to use, and guessing the scheduler's
    address from it would be wrong, so it is an error unless a TEMPER_ variable names the address."""
    for value in (base_url, os.environ.get("TEMPER_BASE_URL"), os.environ.get("TEMPER_ADDRESS")):
        if value:
            return value
    tinker_url = os.environ.get("TINKER_BASE_URL")
    if tinker_url:
        if tinker_url.startswith(("http://", "https://")):
            raise ValueError(f"TINKER_BASE_URL={tinker_url} is an HTTP address: {GRPC_HINT}. Set TEMPER_BASE_URL "
                             f"(or TEMPER_ADDRESS, or base_url=) to the scheduler's gRPC address, e.g. {DEFAULT_BASE_URL}")
        return tinker_url
    return DEFAULT_BASE_URL


def connect_timeout_setting(value: float | None) -> float:
    """``connect_timeout``, else TEMPER_CONNECT_TIMEOUT (seconds), else 30 s; 0 waits forever."""
    if value is not None:
        return float(value)
    return float(os.environ.get("TEMPER_CONNECT_TIMEOUT") or DEFAULT_CONNECT_TIMEOUT)


def resolve_target(base_url: str, root_certificates: bytes | None = None) -> tuple[str, grpc.ChannelCredentials | None]:
    """(target, TLS credentials or None) of a base URL. The address is one host:port, a list
    host1:port1,host2:port2 or dns:///name:port (several replicas: common/channel_target.py), with an
    optional scheme: ``grpcs://host:port`` is TLS, checked against
    ``root_certificates``, else the PEM file TEMPER_TLS_CA_FILE names, else the system's roots;
    ``grpc://host:port`` is plaintext; a bare ``host:port`` is TLS when a CA is given that way.
    TEMPER_TLS_CLIENT_CERT_FILE and TEMPER_TLS_CLIENT_KEY_FILE add a client certificate (mutual TLS)."""
    scheme, sep, target = base_url.partition("://")
    if not sep or base_url.startswith(MULTI_SCHEMES):  # dns:///name:port is a target, not a scheme of ours
        scheme, target = "", base_url
    if scheme not in ("", "grpc", "grpcs"):
        raise ValueError(f"base URL {base_url!r}: the scheme is grpc:// (plaintext) or grpcs:// (TLS); {GRPC_HINT}")
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


def open_runtime(base_url: str | None, api_key: str | None, timeout: float | None = None,
                 root_certificates: bytes | None = None, connect_timeout: float | None = None) -> "Runtime":
    """A connected Runtime for ServiceClient and RestClient: the address from ``resolve_base_url``,
    the key from ``api_key``, else TEMPER_API_KEY, else TINKER_API_KEY (the key says who you are:
    the server has no other notion of a tenant)."""
    target, credentials = resolve_target(resolve_base_url(base_url), root_certificates)
    api_key = api_key or os.environ.get("TEMPER_API_KEY") or os.environ.get("TINKER_API_KEY")
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
    return Runtime(target, metadata, timeout=timeout, credentials=credentials,
                   connect_timeout=connect_timeout_setting(connect_timeout))


class Runtime:
    def __init__(self, target: str, metadata: list[tuple[str, str]], max_retries: int = 8, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, connect_timeout: float = 0.0):
        """``target``: an address as ``channel_target`` reads it; ``credentials``: TLS (``resolve_target``), None for plaintext;
        ``connect_timeout``: seconds to wait for the first connection (0: forever), then APIConnectionError."""
        self.metadata = metadata
        self.credentials = credentials
        self.max_retries = max_retries
        self.timeout = timeout
        channel_target(target)  # a malformed address is a ValueError here, in the caller's thread
        self.owners: OwnerRouting | None = None  # several replicas: each run's lane verbs go to its owner
        self.loop = asyncio.new_event_loop()
        self._background: set[asyncio.Task] = set()  # held here: the loop keeps only weak references
        self._thread = threading.Thread(target=self.loop.run_forever, name="temper-client", daemon=True)
        self._thread.start()
        try:
            self.stub: service_pb2_grpc.TemperStub = self.call_soon(self._connect(target, connect_timeout)).result()
        except BaseException:
            self._stop_loop()
            raise

    async def _connect(self, target: str, connect_timeout: float):
        # Several replicas: round_robin spreads the calls and skips a dead one; a call caught on a
        # replica as it died fails UNAVAILABLE and is resent by _call (through another replica).
        grpc_target, options = channel_target(target)
        if self.credentials is None:
            self.channel = grpc.aio.insecure_channel(grpc_target, options=options)
        else:
            self.channel = grpc.aio.secure_channel(grpc_target, self.credentials, options=options)
        if len(hint_options(options)) < len(options):  # round_robin: several replicas
            self.owners = OwnerRouting(self._replica_channel(hint_options(options)), service_pb2_grpc.TemperStub)
        if connect_timeout > 0:
            # Calls wait for the channel (wait_for_ready: a restarting scheduler is waited for), so a
            # wrong or dead address would hang the first call forever: it is checked once, here.
            try:
                await asyncio.wait_for(self.channel.channel_ready(), connect_timeout)
            except asyncio.TimeoutError:
                await self.channel.close()
                raise APIConnectionError(
                    f"could not connect to a Temper scheduler at {target} within {connect_timeout:g} s. Is it running "
                    f"there? {GRPC_HINT}. Set the address with base_url= or TEMPER_BASE_URL, and the wait with "
                    f"connect_timeout= or TEMPER_CONNECT_TIMEOUT") from None
        return service_pb2_grpc.TemperStub(self.channel)

    def _replica_channel(self, options):
        """Opens a channel to one replica (an owner hint's address), as the main channel is opened."""
        if self.credentials is None:
            return lambda address: grpc.aio.insecure_channel(address, options=options)
        return lambda address: grpc.aio.secure_channel(address, self.credentials, options=options)

    def call_soon(self, coro: Awaitable[Any]):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def rpc(self, method: str, request: Any):
        """Schedule a unary call with retries; returns a concurrent.futures.Future."""
        return self.call_soon(self._call(method, request))

    async def _call(self, method: str, request: Any, forever: bool = False):
        """``forever``: UNAVAILABLE is resent until it passes (for calls nobody waits on)."""
        fn: Callable = getattr(self.stub, method)
        # several replicas: a run's lane verbs go to the owner its last answer named (common/owner_hints.py)
        owners = self.owners if method in LANE_VERBS else None
        delay, failures = 0.05, 0
        while True:
            try:
                if owners is not None:
                    return await owners.call(self.stub, method, request, metadata=self.metadata, timeout=self.timeout,
                                             wait_for_ready=True)
                return await fn(request, metadata=self.metadata, timeout=self.timeout, wait_for_ready=True)
            except grpc.aio.AioRpcError as err:
                # A full queue is backpressure, not failure (as Tinker treats HTTP 429): wait and
                # resend for as long as it takes. Unavailability is retried a bounded number of times.
                if err.code() == grpc.StatusCode.UNAVAILABLE and not forever:
                    failures += 1
                if err.code() not in RETRY_CODES or failures > self.max_retries or is_hard_limit(err.code(), err.details()):
                    raise from_rpc_error(err) from None
            await asyncio.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 2.0)

    async def sequenced(self, method: str, request: Any):
        """A sequenced verb (its request has training_run_id and seq_id). When it fails without settling
        its seq (retries spent in an outage, a deadline, a cancel), the seq is abandoned in the background,
        resent until the scheduler answers: it is then skipped, unless it was recorded, so the run's later
        requests do not wait the scheduler's seq-gap timeout for a seq this client will never resend."""
        try:
            return await self._call(method, request)
        except BaseException as exc:
            if not settles(exc):
                self.abandon(request.training_run_id, request.seq_id)
            raise

    def abandon(self, run_id: str, seq_id: int) -> None:
        """AbandonSeq in the background (call on the loop). Its failure is not anyone's to hear: the
        scheduler's seq-gap timeout remains the backstop (a closed client, a run that is gone)."""
        request = service_pb2.AbandonSeqRequest(training_run_id=run_id, seq_id=seq_id)
        task = self.loop.create_task(self._call("AbandonSeq", request, forever=True))
        self._background.add(task)
        task.add_done_callback(lambda done: (self._background.discard(done), done.cancelled() or done.exception()))

    def stream(self, method: str, request: Any):
        async def collect():
            try:
                return [chunk async for chunk in getattr(self.stub, method)(request, metadata=self.metadata)]
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err) from None

        return self.call_soon(collect())

    def upload(self, method: str, messages: Iterable[Any]):
        """A client-streaming call (sent once, never retried: an upload may have taken effect)."""
        async def send():
            try:
                return await getattr(self.stub, method)(iter(messages), metadata=self.metadata, timeout=self.timeout,
                                                        wait_for_ready=True)
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err) from None

        return self.call_soon(send())

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.call_soon(self.channel.close()).result(timeout=5)
        if self.owners is not None:
            self.call_soon(self.owners.close()).result(timeout=5)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()
