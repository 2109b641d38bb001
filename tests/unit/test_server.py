"""The server every Temper process builds (common/server.py), in-process: the health service's Check
and Watch, and ErrorInterceptor's status codes for unary and both kinds of streaming handlers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from temper.common.errors import NotFound
from temper.common.server import build_server, mark_serving

SERVICE = "temper.test.Echo"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EchoServicer:
    """Raw-bytes methods: a unary call, an async-generator stream and a context.write stream. A
    request of b"missing" raises NotFound, b"boom" a plain exception, after one streamed item."""

    async def Get(self, request, context):
        _maybe_fail(request)
        return request

    async def Yield(self, request, context):
        yield b"first"
        _maybe_fail(request)
        yield request

    async def Write(self, request, context):
        await context.write(b"first")
        _maybe_fail(request)
        await context.write(request)


def _maybe_fail(request: bytes) -> None:
    if request == b"missing":
        raise NotFound("no such thing")
    if request == b"boom":
        raise ValueError("boom")


def _add_echo(servicer, server) -> None:
    handlers = {
        "Get": grpc.unary_unary_rpc_method_handler(servicer.Get),
        "Yield": grpc.unary_stream_rpc_method_handler(servicer.Yield),
        "Write": grpc.unary_stream_rpc_method_handler(servicer.Write),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _with_server(body):
    server, port, health = build_server([(_add_echo, EchoServicer(), SERVICE)], "127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(channel, health)
    finally:
        await server.stop(grace=None)


def run(body) -> None:
    asyncio.run(asyncio.wait_for(_with_server(body), timeout=30))


def test_health_check_and_watch_follow_mark_serving():
    async def body(channel, health):
        stub = health_pb2_grpc.HealthStub(channel)
        await mark_serving(health, [SERVICE], serving=True)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert reply.status == SERVING

        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == SERVING
        await mark_serving(health, [SERVICE], serving=False)
        assert (await watch.read()).status == NOT_SERVING
        watch.cancel()
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert reply.status == NOT_SERVING

    run(body)


def test_health_check_unknown_service_is_not_found():
    async def body(channel, health):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    run(body)


@pytest.mark.parametrize("method", ["Yield", "Write"])
def test_streaming_handlers_stream_and_map_errors(method):
    async def body(channel, health):
        call = channel.unary_stream(f"/{SERVICE}/{method}")
        assert [item async for item in call(b"ok")] == [b"first", b"ok"]
        for request, code in [(b"missing", grpc.StatusCode.NOT_FOUND), (b"boom", grpc.StatusCode.INTERNAL)]:
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for item in call(request):
                    received.append(item)
            assert received == [b"first"]
            assert info.value.code() == code
        # the exception's text stays in the server log (it may carry SQL or the caller's input)
        assert info.value.details() == f"internal error (ValueError) in /{SERVICE}/{method}; see the server log"

    run(body)


def test_unary_handler_maps_errors():
    async def body(channel, health):
        call = channel.unary_unary(f"/{SERVICE}/Get")
        assert await call(b"ok") == b"ok"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(b"missing")
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.NOT_FOUND, "no such thing")

    run(body)
