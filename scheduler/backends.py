"""Connections to trainer and sampler services, which one serves a base model, and the calls to
them, each with its deadline from settings."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from temper.common.errors import AdapterNotLoaded, NotFound, TemperError, Unavailable, from_rpc_error
from temper.common.internal_auth import bearer_interceptors, resolve_token
from temper.common.server_options import CHANNEL_OPTIONS
from temper.common.tls import channel_credentials
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)
# A worker that does not answer in time, or cannot be reached: the call's outcome is unknown.
UNKNOWN_OUTCOME_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@asynccontextmanager
async def downstream(what: str):
    """Turn a failed call to a trainer or sampler into the matching domain error; no answer in time
    or no connection becomes Unavailable (retryable: the outcome is not known)."""
    try:
        yield
    except grpc.aio.AioRpcError as err:
        exc = from_rpc_error(err)
        if err.code() in UNKNOWN_OUTCOME_CODES:
            exc = Unavailable(f"{what} did not answer ({err.code().name}): {err.details()}")
        raise exc from None


@dataclass
class TrainerHandle:
    address: str
    stub: trainer_pb2_grpc.TrainerStub
    info: trainer_pb2.ModelInfo
    settings: SchedulerSettings

    async def run_cycle(self, request: trainer_pb2.CycleRequest) -> trainer_pb2.CycleResponse:
        async with downstream(f"trainer {self.address}"):
            return await self.stub.RunCycle(request, timeout=self.settings.cycle_timeout_seconds)

    async def call(self, method: str, request):
        """A unary trainer call other than RunCycle (CreateAdapter, SaveAdapter, LoadAdapter, ...)."""
        async with downstream(f"trainer {self.address}"):
            return await getattr(self.stub, method)(request, timeout=self.settings.trainer_call_timeout_seconds)

    async def delete_checkpoint(self, key: str) -> int:
        """Remove a checkpoint's files; the bytes freed (0 if there were none: deleting twice is fine)."""
        response = await self.call("DeleteCheckpoint", trainer_pb2.DeleteCheckpointFilesRequest(checkpoint_key=key))
        return response.freed_bytes

    async def read_checkpoint(self, key: str, weights_only: bool = False):
        request = trainer_pb2.ReadCheckpointRequest(checkpoint_key=key, weights_only=weights_only)
        async with downstream(f"trainer {self.address}"):
            async for chunk in self.stub.ReadCheckpoint(request, timeout=self.settings.trainer_call_timeout_seconds):
                yield chunk


@dataclass
class SamplerHandle:
    address: str
    stub: sampler_pb2_grpc.SamplerStub
    info: sampler_pb2.SamplerModelInfo
    settings: SchedulerSettings
    # checkpoint keys pushed here -> the tenant that pushed it ("": not known), least recently used first
    loaded: OrderedDict[str, str] = field(default_factory=OrderedDict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # pushes and drops, one at a time

    async def call(self, method: str, request):
        async with downstream(f"sampler {self.address}"):
            return await getattr(self.stub, method)(request, timeout=self.settings.sampler_call_timeout_seconds)

    def touch(self, key: str) -> None:
        if key in self.loaded:
            self.loaded.move_to_end(key)

    async def drop_adapter(self, key: str) -> bool:
        """Drop the adapter there (once the requests using it are done); False if it did not hold it."""
        try:
            await self.call("DropAdapter", sampler_pb2.SamplerDropAdapterRequest(checkpoint_key=key))
        except TemperError as exc:
            if not AdapterNotLoaded.matches(exc):
                raise  # still counted as here: a retry asks again
            self.loaded.pop(key, None)
            return False
        self.loaded.pop(key, None)
        return True


class Backends:
    def __init__(self, settings: SchedulerSettings):
        self.settings = settings
        self.trainers: list[TrainerHandle] = []
        self.samplers: list[SamplerHandle] = []
        self._channels: list[grpc.aio.Channel] = []
        self._ready = asyncio.Event()
        # Every call to a worker carries the internal token (common/internal_auth.py), streams included.
        token = resolve_token(settings, "TEMPER_SCHEDULER_")
        if token is None:
            log.warning("no TEMPER_SCHEDULER_INTERNAL_TOKEN: trainers and samplers answer only with internal_auth=disabled")
        self._interceptors = bearer_interceptors(token) if token else []
        self._credentials = None
        if settings.internal_tls_ca_file is not None:
            self._credentials = channel_credentials(settings.internal_tls_ca_file, settings.internal_tls_cert_file,
                                                    settings.internal_tls_key_file)

    def _channel(self, address: str) -> grpc.aio.Channel:
        # A worker that restarts is found again within seconds (gRPC's default backoff grows to 2 min).
        options = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000)]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=options, interceptors=self._interceptors)
        else:
            if self.settings.internal_tls_server_name:
                options.append(("grpc.ssl_target_name_override", self.settings.internal_tls_server_name))
            channel = grpc.aio.secure_channel(address, self._credentials, options=options, interceptors=self._interceptors)
        self._channels.append(channel)
        return channel

    async def connect(self) -> None:
        """Wait (as long as it takes) for every configured service to answer GetModelInfo."""
        for address in self.settings.trainer_addresses:
            stub = trainer_pb2_grpc.TrainerStub(self._channel(address))
            info = await self._model_info(f"trainer {address}", stub.GetModelInfo, trainer_pb2.GetModelInfoRequest())
            self.trainers.append(TrainerHandle(address, stub, info, self.settings))
            log.info("trainer %s serves %s", address, info.base_model)
        for address in self.settings.sampler_addresses:
            stub = sampler_pb2_grpc.SamplerStub(self._channel(address))
            info = await self._model_info(f"sampler {address}", stub.GetModelInfo, sampler_pb2.SamplerModelInfoRequest())
            handle = SamplerHandle(address, stub, info, self.settings)
            handle.loaded.update((key, "") for key in info.loaded_adapters)  # held since before a restart of ours
            self.samplers.append(handle)
            log.info("sampler %s (%s) serves %s", address, info.backend, info.base_model)
        self._ready.set()

    @staticmethod
    async def _model_info(what: str, method, request):
        while True:
            try:
                return await method(request, wait_for_ready=True, timeout=10.0)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    # a worker restarted with the right token is found on a later try
                    log.error("%s refused the scheduler (%s): TEMPER_SCHEDULER_INTERNAL_TOKEN must be the worker's "
                              "INTERNAL_TOKEN; retrying", what, err.details())
                    await asyncio.sleep(5.0)
                    continue
                if err.code() not in UNKNOWN_OUTCOME_CODES:
                    raise
                log.warning("waiting for %s (%s)", what, err.code().name)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self) -> None:
        """Return once every worker has answered; past backend_wait_seconds, Unavailable (retry)."""
        if self._ready.is_set():
            return
        try:
            await asyncio.wait_for(self._ready.wait(), self.settings.backend_wait_seconds)
        except asyncio.TimeoutError:
            raise Unavailable("the scheduler is still connecting to its trainers and samplers; retry") from None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    def model_names(self) -> list[str]:
        return sorted({t.info.base_model for t in self.trainers} | {s.info.base_model for s in self.samplers})

    def trainer_for(self, base_model: str, run_id: str) -> TrainerHandle:
        """The trainer holding ``run_id``'s adapter: stable per run among trainers of the model."""
        candidates = [t for t in self.trainers if t.info.base_model == base_model]
        if not candidates:
            raise NotFound(f"no trainer serves base model {base_model!r}; served: {self.model_names()}")
        return candidates[zlib.crc32(run_id.encode()) % len(candidates)]

    def sampler_for(self, base_model: str) -> SamplerHandle:
        candidates = [s for s in self.samplers if s.info.base_model == base_model]
        if not candidates:
            raise NotFound(f"no sampler serves base model {base_model!r}; served: {self.model_names()}")
        return candidates[0]

    async def push_checkpoint(self, trainer: TrainerHandle, sampler: SamplerHandle, key: str, tenant: str = "",
                              max_resident: int = 0) -> None:
        """Stream a checkpoint's adapter files from the trainer to the sampler, once per sampler (a key
        already there becomes its most recently used). ``max_resident`` > 0 is the tenant's limit of
        adapters on this sampler: its own least recently used ones are dropped first, never another
        tenant's. A key pushed without a tenant (at save time) counts for the first tenant that uses it."""
        if sampler.loaded.get(key, "") or (key in sampler.loaded and not tenant):
            sampler.loaded.move_to_end(key)  # the common case: no lock (a push or drop may be under way)
            return
        async with sampler.lock:
            if key in sampler.loaded:
                sampler.loaded.move_to_end(key)
                if tenant and not sampler.loaded[key]:
                    sampler.loaded[key] = tenant
                    await self._within_limit(sampler, tenant, max_resident, keep=key)
                return
            await self._within_limit(sampler, tenant, max_resident, keep=key)

            # Read whole before pushing: a trainer error (the files are gone) is then an ordinary error
            # here, not an exception inside the push's request stream (which grpc.aio does not end).
            files = [sampler_pb2.PushAdapterChunk(file=chunk) async for chunk in trainer.read_checkpoint(key, weights_only=True)]

            async def chunks():
                yield sampler_pb2.PushAdapterChunk(checkpoint_key=key)
                for chunk in files:
                    yield chunk

            async with downstream(f"pushing {key} to sampler {sampler.address}"):
                await sampler.stub.PushAdapter(chunks(), timeout=self.settings.sampler_call_timeout_seconds)
            sampler.loaded[key] = tenant

    @staticmethod
    async def _within_limit(sampler: SamplerHandle, tenant: str, max_resident: int, keep: str) -> None:
        """Drop the tenant's least recently used adapters until ``keep`` fits in ``max_resident`` (under sampler.lock)."""
        if max_resident <= 0:
            return
        own = [k for k, t in sampler.loaded.items() if t == tenant and k != keep]
        for victim in own[: max(len(own) - (max_resident - 1), 0)]:
            await sampler.drop_adapter(victim)
            log.info("dropped %s from sampler %s: tenant %s keeps at most %d adapters there", victim, sampler.address,
                     tenant, max_resident)

    async def sample_call(self, sampler: SamplerHandle, method: str, request,
                          reload: Callable[[], Awaitable[None]] | None = None):
        """A Sample or ComputeLogprobs call. A sampler that no longer holds the request's adapter (it
        evicted it, or restarted) answers AdapterNotLoaded: ``reload`` (which pushes it again) runs and
        the call is retried once."""
        key = request.checkpoint_key
        sampler.touch(key)
        try:
            return await sampler.call(method, request)
        except TemperError as exc:
            if not (key and reload is not None and AdapterNotLoaded.matches(exc)):
                raise
        log.info("sampler %s no longer holds %s: pushing it again", sampler.address, key)
        sampler.loaded.pop(key, None)
        await reload()
        return await sampler.call(method, request)

    async def forget_checkpoint(self, key: str) -> None:
        """Drop a (deleted) checkpoint's adapter from every sampler. All are asked, since a restarted
        scheduler does not know where it pushed before; one that does not hold it is fine, and one that
        cannot be reached is skipped unless this scheduler pushed the key there (then Unavailable)."""

        async def forget(sampler: SamplerHandle) -> None:
            async with sampler.lock:
                pushed = key in sampler.loaded
                try:
                    await sampler.drop_adapter(key)
                except Unavailable as exc:
                    if pushed:
                        raise
                    log.warning("could not ask sampler %s to drop %s: %s", sampler.address, key, exc.message)

        results = await asyncio.gather(*(forget(s) for s in self.samplers), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
