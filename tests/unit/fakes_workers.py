"""A trainer and a sampler without a model, served by the real ``build_server`` (error interceptor,
health, an optional authenticator and TLS), for the scheduler's channels to its workers
(scheduler/workers/backends.py): one unary, one server-streaming and one client-streaming call each way."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from temper.common.server import build_server, mark_serving
from temper.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2

MODEL = "fake-model"
TRAINER = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
SAMPLER = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"].full_name
PAYLOAD = b"adapter bytes"


class ModelessTrainer(trainer_pb2_grpc.TrainerServicer):
    async def GetModelInfo(self, request, context):
        return trainer_pb2.ModelInfo(base_model=MODEL, vocab_size=8, max_context_length=16)

    async def ReadCheckpoint(self, request, context):
        yield types_pb2.FileChunk(relative_path="adapter_model.safetensors", data=PAYLOAD, total_size=len(PAYLOAD))


@dataclass
class ModelessSampler(sampler_pb2_grpc.SamplerServicer):
    pushed: dict[str, bytes] = field(default_factory=dict)

    async def GetModelInfo(self, request, context):
        return sampler_pb2.SamplerModelInfo(base_model=MODEL, backend="fake", vocab_size=8, max_context_length=16)

    async def PushAdapter(self, request_iterator, context):
        key, data = "", b""
        async for chunk in request_iterator:
            if chunk.HasField("file"):
                data += chunk.file.data
            else:
                key = chunk.checkpoint_key
        self.pushed[key] = data
        return sampler_pb2.PushAdapterResponse(bytes_received=len(data))


@dataclass
class Workers:
    trainer_address: str
    sampler_address: str
    sampler: ModelessSampler


@asynccontextmanager
async def modeless_workers(authenticate=None, credentials=None):
    """Start both servers on free loopback ports, SERVING; yields their addresses."""
    sampler = ModelessSampler()
    servers, ports = [], []
    for add, servicer, name in ((trainer_pb2_grpc.add_TrainerServicer_to_server, ModelessTrainer(), TRAINER),
                                (sampler_pb2_grpc.add_SamplerServicer_to_server, sampler, SAMPLER)):
        server, port, health = build_server([(add, servicer, name)], "127.0.0.1:0", authenticate, credentials)
        await server.start()
        await mark_serving(health, [name])
        servers.append(server)
        ports.append(port)
    try:
        yield Workers(f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", sampler)
    finally:
        for server in servers:
            await server.stop(grace=None)
