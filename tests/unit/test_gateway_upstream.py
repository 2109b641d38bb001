"""The gateway's verbs to the scheduler (services/gateway/upstream.py): resent on backpressure for as
long as it lasts, resent while the scheduler is unreachable for a bounded window that backpressure
starts again, other errors at once, each answer mapped to a GatewayError. A fake stub, no network."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from temper.services.gateway.errors import GatewayError
from temper.services.gateway.upstream import Scheduler


class Failure(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str = ""):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details or code.name)


class FakeStub:
    """Answers ``script`` in turn (an exception is raised), then "done"."""

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def __getattr__(self, method):
        async def call(request, metadata=(), timeout=None):
            self.calls.append((method, request, metadata))
            if self.script:
                raise self.script.pop(0)
            return "done"

        return call


def scheduler(script, unavailable_seconds=30.0) -> tuple[Scheduler, FakeStub]:
    upstream = Scheduler("unused:1", unavailable_seconds=unavailable_seconds)
    upstream._stub = stub = FakeStub(script)
    return upstream, stub


UNAVAILABLE, BUSY = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED


def test_backpressure_and_unreachability_are_resent_with_the_callers_key():
    upstream, stub = scheduler([Failure(BUSY, "queue full"), Failure(UNAVAILABLE), Failure(BUSY), Failure(UNAVAILABLE)])
    assert asyncio.run(upstream.verb("ForwardBackward", "req", "k1")) == "done"
    assert len(stub.calls) == 5
    assert all(c == ("ForwardBackward", "req", (("authorization", "Bearer k1"),)) for c in stub.calls)


@pytest.mark.parametrize("code,details", [(grpc.StatusCode.INVALID_ARGUMENT, "bad seq"), (BUSY, "limit runs: 3 of 3"),
                                          (grpc.StatusCode.NOT_FOUND, "no such run")])
def test_other_errors_and_hard_limits_are_answered_at_once_mapped(code, details):
    upstream, stub = scheduler([Failure(code, details)])
    with pytest.raises(GatewayError) as raised:
        asyncio.run(upstream.verb("Sample", "req", None))
    assert (raised.value.code, raised.value.message) == (code, details)
    assert len(stub.calls) == 1


def test_an_unreachable_scheduler_is_given_up_on_with_its_last_error():
    upstream, stub = scheduler([Failure(UNAVAILABLE, f"down {i}") for i in range(1000)], unavailable_seconds=0.0)
    with pytest.raises(GatewayError) as raised:
        asyncio.run(upstream.verb("Sample", "req", None))
    # a window of 0 s: the first failure is the last; the error is the scheduler's own
    assert len(stub.calls) == 1
    assert (raised.value.code, raised.value.message) == (UNAVAILABLE, "down 0")


def test_backpressure_starts_the_unreachable_window_again(monkeypatch):
    """Each call takes 1 s on a fake clock; a 2.5 s window from a stretch's first failure. Two stretches
    of two UNAVAILABLE answers, 5 s of them together, are resent because a backpressure answer ends
    each; in the third, the 4th failure (3.35 s into the window) is the last."""
    import functools

    from temper.common import retry as retry_module
    from temper.services.gateway import upstream as upstream_module

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

        async def sleep(self, seconds):
            self.now += seconds

    clock = Clock()
    monkeypatch.setattr(upstream_module, "retry", functools.partial(retry_module.retry, clock=clock, sleep=clock.sleep,
                                                                    rand=lambda: 0.0))
    down = [Failure(UNAVAILABLE)] * 2
    upstream, stub = scheduler([*down, Failure(BUSY), *down, Failure(BUSY), *down * 3], unavailable_seconds=2.5)
    original = FakeStub.__getattr__

    def timed(self, method):
        call = original(self, method)

        async def taking_a_second(*args, **kwargs):
            clock.now += 1.0
            return await call(*args, **kwargs)

        return taking_a_second

    monkeypatch.setattr(FakeStub, "__getattr__", timed)
    with pytest.raises(GatewayError) as raised:
        asyncio.run(upstream.verb("Sample", "req", None))
    assert raised.value.code == UNAVAILABLE
    assert len(stub.calls) == 3 + 3 + 4
