"""Connections to trainer and sampler services, and which one serves a base model."""

from __future__ import annotations

import asyncio
import logging
import zlib
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc

from temper.common.errors import NotFound, Unavailable, from_rpc_error
from temper.common.server_options import CHANNEL_OPTIONS
from temper.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class TrainerHandle:
    address: str
    stub: trainer_pb2_grpc.TrainerStub
    info: trainer_pb2.ModelInfo


@dataclass
class SamplerHandle:
    address: str
    stub: sampler_pb2_grpc.SamplerStub
    info: sampler_pb2.SamplerModelInfo
    loaded: set[str] = field(default_factory=set)   # adapter ids (checkpoint keys) pushed here
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@asynccontextmanager
async def downstream(what: str):
    """Turn a failed call to a trainer or sampler into the matching domain error."""
    try:
        yield
    except grpc.aio.AioRpcError as err:
        exc = from_rpc_error(err)
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            exc = Unavailable(f"{what} is unavailable: {err.details()}")
        raise exc from None


class Backends:
    def __init__(self, trainer_addresses: list[str], sampler_addresses: list[str]):
        self._trainer_addresses = trainer_addresses
        self._sampler_addresses = sampler_addresses
        self.trainers: list[TrainerHandle] = []
        self.samplers: list[SamplerHandle] = []
        self._channels: list[grpc.aio.Channel] = []

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._channels.append(channel)
        return channel

    async def connect(self, wait_seconds: float) -> None:
        """Wait for every configured service to answer GetModelInfo."""
        for address in self._trainer_addresses:
            stub = trainer_pb2_grpc.TrainerStub(self._channel(address))
            async with downstream(f"trainer {address}"):
                info = await stub.GetModelInfo(trainer_pb2.GetModelInfoRequest(), wait_for_ready=True, timeout=wait_seconds)
            self.trainers.append(TrainerHandle(address, stub, info))
            log.info("trainer %s serves %s", address, info.base_model)
        for address in self._sampler_addresses:
            stub = sampler_pb2_grpc.SamplerStub(self._channel(address))
            async with downstream(f"sampler {address}"):
                info = await stub.GetModelInfo(sampler_pb2.SamplerModelInfoRequest(), wait_for_ready=True, timeout=wait_seconds)
            self.samplers.append(SamplerHandle(address, stub, info))
            log.info("sampler %s (%s) serves %s", address, info.backend, info.base_model)

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
                async for chunk in trainer.stub.ReadCheckpoint(trainer_pb2.ReadCheckpointRequest(checkpoint_key=key, weights_only=True)):
                    yield sampler_pb2.PushAdapterChunk(file=chunk)

            async with downstream(f"pushing {key} to sampler {sampler.address}"):
                await sampler.stub.PushAdapter(chunks())
            sampler.loaded.add(key)
