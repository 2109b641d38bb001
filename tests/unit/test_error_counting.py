"""Failed calls are counted by the one error interceptor (common/errors.py, installed by
common/server.build_server on every Temper server): temper_rpc_errors_total{service, method, code},
once per failed call, by the status sent; whatever the handler's kind, refusals by the authenticator
included, successes not. The trainer's and sampler's servicers count nothing themselves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import REGISTRY

from temper.common.errors import InvalidArgument, NotFound, Unauthenticated
from temper.common.server import build_server
from temper.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2

SERVICE = "temper.test.Counted"


def count(service: str, method: str, code: str) -> float:
    return REGISTRY.get_sample_value("temper_rpc_errors_total", {"service": service, "method": method, "code": code}) or 0.0


class Counted:
    async def Get(self, request, context):
        if request == b"missing":
            raise NotFound("no such thing")
        if request == b"boom":
            raise ValueError("boom")
        return request

    async def Yield(self, request, context):
        yield b"first"
        raise InvalidArgument("bad second item")

    async def Upload(self, request_iterator, context):
        async for item in request_iterator:
            if item == b"bad":
                raise InvalidArgument("bad chunk")
        return b"ok"


def _add(servicer, server) -> None:
    handlers = {"Get": grpc.unary_unary_rpc_method_handler(servicer.Get),
                "Yield": grpc.unary_stream_rpc_method_handler(servicer.Yield),
                "Upload": grpc.stream_unary_rpc_method_handler(servicer.Upload)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _authenticate(method, context):
    if dict(context.invocation_metadata()).get("key") == "wrong":
        raise Unauthenticated("wrong key")


async def _serve(registrations, body, authenticate=None):
    server, port, _ = build_server(registrations, "127.0.0.1:0", authenticate)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(channel)
    finally:
        await server.stop(grace=None)


async def _fails(call, code: grpc.StatusCode):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    assert info.value.code() == code


def test_every_kind_of_handler_counts_each_failed_call_once_by_the_status_sent():
    labels = [("Get", "NOT_FOUND"), ("Get", "INTERNAL"), ("Yield", "INVALID_ARGUMENT"), ("Upload", "INVALID_ARGUMENT"),
              ("Get", "UNAUTHENTICATED"), ("Get", "OK")]
    before = {label: count(SERVICE, *label) for label in labels}

    async def body(channel):
        get = channel.unary_unary(f"/{SERVICE}/Get")
        assert await get(b"fine") == b"fine"
        await _fails(lambda: get(b"missing"), grpc.StatusCode.NOT_FOUND)
        await _fails(lambda: get(b"boom"), grpc.StatusCode.INTERNAL)
        await _fails(lambda: get(b"boom"), grpc.StatusCode.INTERNAL)
        await _fails(lambda: channel.unary_stream(f"/{SERVICE}/Yield")(b"x"), grpc.StatusCode.INVALID_ARGUMENT)

        async def chunks():
            yield b"good"
            yield b"bad"

        await _fails(lambda: channel.stream_unary(f"/{SERVICE}/Upload")(chunks()), grpc.StatusCode.INVALID_ARGUMENT)
        await _fails(lambda: get(b"fine", metadata=(("key", "wrong"),)), grpc.StatusCode.UNAUTHENTICATED)

    asyncio.run(_serve([(_add, Counted(), SERVICE)], body, _authenticate))
    moved = {label: count(SERVICE, *label) - before[label] for label in labels}
    assert moved == {("Get", "NOT_FOUND"): 1, ("Get", "INTERNAL"): 2, ("Yield", "INVALID_ARGUMENT"): 1,
                     ("Upload", "INVALID_ARGUMENT"): 1, ("Get", "UNAUTHENTICATED"): 1, ("Get", "OK"): 0}


class _RefusingEngine:
    def drop_adapter(self, run_id):
        raise NotFound(f"{run_id} is not loaded")


class _IdleBackend:
    name = "fake"

    def describe(self):
        return SimpleNamespace(loaded_checkpoints=[])


def test_the_trainer_and_the_sampler_are_counted_by_the_interceptor_alone(tmp_path):
    """Their servicers counted failures by hand before; now a failure is counted once, and only in
    the shared series."""
    from temper.services.sampler.servicer import SamplerServicer
    from temper.services.trainer.servicer import TrainerServicer

    trainer_name = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
    sampler_name = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"].full_name
    before = (count(trainer_name, "DropAdapter", "NOT_FOUND"), count(sampler_name, "PushAdapter", "INVALID_ARGUMENT"))

    async def body(channel):
        await _fails(lambda: trainer_pb2_grpc.TrainerStub(channel).DropAdapter(
            trainer_pb2.DropAdapterRequest(training_run_id="run-x")), grpc.StatusCode.NOT_FOUND)

        async def push():
            yield sampler_pb2.PushAdapterChunk(file=types_pb2.FileChunk(relative_path="../evil", data=b"x"))

        await _fails(lambda: sampler_pb2_grpc.SamplerStub(channel).PushAdapter(push()), grpc.StatusCode.INVALID_ARGUMENT)

    registrations = [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(_RefusingEngine()), trainer_name),
                     (sampler_pb2_grpc.add_SamplerServicer_to_server, SamplerServicer(_IdleBackend(), tmp_path, 4), sampler_name)]
    asyncio.run(_serve(registrations, body))
    after = (count(trainer_name, "DropAdapter", "NOT_FOUND"), count(sampler_name, "PushAdapter", "INVALID_ARGUMENT"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    names = {metric.name for metric in REGISTRY.collect()}
    assert not names & {"temper_trainer_errors", "temper_sampler_errors"}  # no second, hand-kept series
