"""Connections to trainer and sampler services, which one serves a base model, and the calls to
them, each with its deadline from settings."""

from __future__ import annotations

import asyncio
import logging
import zlib
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc

from temper.common.errors import NotFound, Unavailable, from_rpc_error
from temper.common.server_options import CHANNEL_OPTIONS
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
    loaded: set[str] = field(default_factory=set)   # checkpoint keys pushed here
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def call(self, method: str, request):
        async with downstream(f"sampler {self.address}"):
            return await getattr(self.stub, method)(request, timeout=self.settings.sampler_call_timeout_seconds)


class Backends:
    def __init__(self, settings: SchedulerSettings):
        self.settings = settings
        self.trainers: list[TrainerHandle] = []
        self.samplers: list[SamplerHandle] = []
        self._channels: list[grpc.aio.Channel] = []
        self._ready = asyncio.Event()

    def _channel(self, address: str) -> grpc.aio.Channel:
        # A worker that restarts is found again within seconds (gRPC's default backoff grows to 2 min).
        options = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 5000)]
        channel = grpc.aio.insecure_channel(address, options=options)
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
            self.samplers.append(SamplerHandle(address, stub, info, self.settings))
            log.info("sampler %s (%s) serves %s", address, info.backend, info.base_model)
        self._ready.set()

    @staticmethod
    async def _model_info(what: str, method, request):
        while True:
            try:
                return await method(request, wait_for_ready=True, timeout=10.0)
            except grpc.aio.AioRpcError as err:
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

    async def push_checkpoint(self, trainer: TrainerHandle, sampler: SamplerHandle, key: str) -> None:
        """Stream a checkpoint's adapter files from the trainer to the sampler (once per sampler)."""
        async with sampler.lock:
            if key in sampler.loaded:
                return

            async def chunks():
                yield sampler_pb2.PushAdapterChunk(checkpoint_key=key)
                async for chunk in trainer.read_checkpoint(key, weights_only=True):
                    yield sampler_pb2.PushAdapterChunk(file=chunk)

            async with downstream(f"pushing {key} to sampler {sampler.address}"):
                await sampler.stub.PushAdapter(chunks(), timeout=self.settings.sampler_call_timeout_seconds)
            sampler.loaded.add(key)
