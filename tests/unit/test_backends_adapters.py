"""The scheduler's view of adapters on samplers (scheduler/workers/backends.py) against fake sampler stubs
that answer like the real sampler: a per-tenant limit drops the tenant's own least recently used
adapter, never another tenant's; a call that answers "not loaded" is pushed again and retried once;
a deleted checkpoint is dropped from every sampler; the trainer's DeleteCheckpoint reports bytes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from temper.common.errors import AdapterNotLoaded, FailedPrecondition, Unavailable, from_rpc_error
from temper.scheduler.workers.backends import Backends, SamplerHandle, TrainerHandle
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import sampler_pb2, trainer_pb2, types_pb2

SETTINGS = SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0", sampler_retry_seconds=0)  # each sampler once


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeSamplerStub:
    """Holds adapters like a sampler: DropAdapter, Sample and ComputeLogprobs of one it does not hold
    answer FAILED_PRECONDITION "ADAPTER_NOT_LOADED: ..." (the servicer's exact error, on the wire).
    ``down``: every call answers UNAVAILABLE; ``gate``: Sample waits for it, then answers (or, when
    ``down`` was set meanwhile, fails UNAVAILABLE like a connection that dropped mid-call)."""

    def __init__(self, incarnation: str = "first"):
        self.held: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.down = False
        self.incarnation = incarnation
        self.info_calls = 0
        self.gate: asyncio.Event | None = None
        self.waiting = 0

    def restart(self, incarnation: str) -> None:
        """A new process: no adapters, a new incarnation."""
        self.held.clear()
        self.incarnation = incarnation

    def info(self) -> sampler_pb2.SamplerModelInfo:
        return sampler_pb2.SamplerModelInfo(base_model="m", incarnation=self.incarnation, loaded_adapters=sorted(self.held))

    async def GetModelInfo(self, request, timeout=None):
        self.info_calls += 1
        if self.down:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return self.info()

    def _check(self, method: str, key: str) -> None:
        self.calls.append((method, key))
        if self.down:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if key and key not in self.held:
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, AdapterNotLoaded(key).message)

    async def PushAdapter(self, chunks, timeout=None):
        messages = [m async for m in chunks]
        key = messages[0].checkpoint_key
        assert [m.file.relative_path for m in messages[1:]] == ["adapter_model.safetensors"]
        self._check("PushAdapter", "")
        self.held.add(key)
        return sampler_pb2.PushAdapterResponse(bytes_received=len(messages[1].file.data))

    async def DropAdapter(self, request, timeout=None):
        self._check("DropAdapter", request.checkpoint_key)
        self.held.discard(request.checkpoint_key)
        return sampler_pb2.SamplerDropAdapterResponse()

    async def Sample(self, request, timeout=None):
        self._check("Sample", request.checkpoint_key)
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
            self.waiting -= 1
            if self.down:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        return types_pb2.SampleResponse(sequences=[types_pb2.SampledSequence(tokens=self.incarnation.encode())])

    async def ComputeLogprobs(self, request, timeout=None):
        self._check("ComputeLogprobs", request.checkpoint_key)
        return sampler_pb2.ComputeLogprobsResponseInternal()


class FakeTrainer:
    async def read_checkpoint(self, key: str, weights_only: bool = False):
        assert weights_only
        yield types_pb2.FileChunk(relative_path="adapter_model.safetensors", data=key.encode(), total_size=len(key))


def sampler(address: str = "fake-sampler:1", settings: SchedulerSettings = SETTINGS) -> SamplerHandle:
    stub = FakeSamplerStub(incarnation=address)
    return SamplerHandle(address, stub, stub.info(), settings)


def backends(*samplers: SamplerHandle, settings: SchedulerSettings = SETTINGS) -> Backends:
    b = Backends(settings)
    b.samplers.extend(samplers)
    return b


def test_the_not_loaded_signal_survives_the_wire():
    sent = AdapterNotLoaded("run/sampler_weights/a")
    received = from_rpc_error(rpc_error(sent.code, sent.message))
    assert isinstance(received, FailedPrecondition) and AdapterNotLoaded.matches(received)
    assert not AdapterNotLoaded.matches(from_rpc_error(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "the session is closed")))
    assert not AdapterNotLoaded.matches(from_rpc_error(rpc_error(grpc.StatusCode.NOT_FOUND, sent.message)))


def test_a_tenant_over_its_limit_drops_its_own_least_recently_used_adapter():
    s, trainer = sampler(), FakeTrainer()
    b = backends(s)

    async def scenario():
        for key, tenant in [("k1", "t1"), ("k2", "t2"), ("k3", "t1"), ("k4", "t2")]:
            await b.push_checkpoint(trainer, s, key, tenant=tenant, max_resident=2)
        assert list(s.loaded.items()) == [("k1", "t1"), ("k2", "t2"), ("k3", "t1"), ("k4", "t2")]
        # t1 is at its limit: its least recently used (k1) goes, not k2 (older, but t2's)
        await b.push_checkpoint(trainer, s, "k5", tenant="t1", max_resident=2)
        assert list(s.loaded) == ["k2", "k3", "k4", "k5"] and s.stub.held == {"k2", "k3", "k4", "k5"}
        # using k3 makes k5 t1's least recently used one
        await b.sample_call(s, "Sample", sampler_pb2.SamplerSampleRequest(checkpoint_key="k3"))
        await b.push_checkpoint(trainer, s, "k6", tenant="t1", max_resident=2)
        assert list(s.loaded.items()) == [("k2", "t2"), ("k4", "t2"), ("k3", "t1"), ("k6", "t1")]
        assert [key for method, key in s.stub.calls if method == "DropAdapter"] == ["k1", "k5"]
        # pushing one already there only makes it the most recently used
        pushes = len([c for c in s.stub.calls if c[0] == "PushAdapter"])
        await b.push_checkpoint(trainer, s, "k2", tenant="t2", max_resident=2)
        assert list(s.loaded)[-1] == "k2" and len([c for c in s.stub.calls if c[0] == "PushAdapter"]) == pushes
        # a victim the sampler already evicted by itself is fine; no limit: nothing is dropped
        s.stub.held.discard("k3")
        await b.push_checkpoint(trainer, s, "k7", tenant="t1", max_resident=2)
        assert list(s.loaded.items()) == [("k4", "t2"), ("k6", "t1"), ("k2", "t2"), ("k7", "t1")]
        await b.push_checkpoint(trainer, s, "k8", tenant="t2")
        assert len(s.loaded) == 5

    asyncio.run(scenario())


def test_a_key_pushed_without_a_tenant_counts_for_the_first_tenant_that_uses_it():
    s, trainer = sampler(), FakeTrainer()
    b = backends(s)

    async def scenario():
        await b.push_checkpoint(trainer, s, "a1", tenant="alice", max_resident=1)
        await b.push_checkpoint(trainer, s, "a2")  # at save time, tenant not known
        assert s.loaded == {"a1": "alice", "a2": ""}
        await b.push_checkpoint(trainer, s, "a2", tenant="alice", max_resident=1)
        assert s.loaded == {"a2": "alice"} and s.stub.held == {"a2"}

    asyncio.run(scenario())


def test_a_call_answered_not_loaded_is_pushed_again_and_retried_once():
    s, trainer = sampler(), FakeTrainer()
    b = backends(s)
    reloads = []

    async def reload():
        reloads.append(1)
        await b.push_checkpoint(trainer, s, "k", tenant="t", max_resident=4)

    async def scenario():
        await reload()
        s.stub.held.clear()  # the sampler evicted it (or restarted)
        s.stub.calls.clear()
        response = await b.sample_call(s, "ComputeLogprobs", sampler_pb2.SamplerLogprobsRequest(checkpoint_key="k"), reload)
        assert isinstance(response, sampler_pb2.ComputeLogprobsResponseInternal)
        assert s.stub.calls == [("ComputeLogprobs", "k"), ("PushAdapter", ""), ("ComputeLogprobs", "k")]
        assert len(reloads) == 2 and s.loaded == {"k": "t"}

        async def lost_again():  # a reload that does not help: the second answer is the caller's
            reloads.append(1)
            s.stub.held.clear()

        s.stub.held.clear()
        with pytest.raises(FailedPrecondition) as raised:
            await b.sample_call(s, "Sample", sampler_pb2.SamplerSampleRequest(checkpoint_key="k"), lost_again)
        assert AdapterNotLoaded.matches(raised.value) and len(reloads) == 3
        # the base model, or no reload given: no retry
        s.stub.calls.clear()
        with pytest.raises(FailedPrecondition):
            await b.sample_call(s, "Sample", sampler_pb2.SamplerSampleRequest(checkpoint_key="k"))
        assert s.stub.calls == [("Sample", "k")] and len(reloads) == 3
        await b.sample_call(s, "Sample", sampler_pb2.SamplerSampleRequest(), reload)
        # another error is not retried
        s.stub.down = True
        with pytest.raises(Unavailable):
            await b.sample_call(s, "Sample", sampler_pb2.SamplerSampleRequest(checkpoint_key="k"), reload)
        assert len(reloads) == 3

    asyncio.run(scenario())


def test_forget_drops_a_checkpoint_everywhere():
    holder, other, gone = sampler("s1:1"), sampler("s2:1"), sampler("s3:1")
    trainer = FakeTrainer()
    b = backends(holder, other, gone)

    async def scenario():
        await b.push_checkpoint(trainer, holder, "k", tenant="t")
        await b.push_checkpoint(trainer, holder, "keep", tenant="t")
        other.stub.held.add("k")  # pushed there by a scheduler before a restart: not in other.loaded
        gone.stub.down = True     # never got it from this scheduler: skipped
        await b.forget_checkpoint("k")
        assert holder.stub.held == {"keep"} and list(holder.loaded) == ["keep"]
        assert other.stub.held == set() and ("DropAdapter", "k") in gone.stub.calls
        await b.forget_checkpoint("k")  # again: nobody holds it, fine
        # a sampler this scheduler pushed it to must confirm: unreachable, the deletion is retried
        holder.stub.down = True
        with pytest.raises(Unavailable):
            await b.forget_checkpoint("keep")
        assert "keep" in holder.loaded
        holder.stub.down = False
        await b.forget_checkpoint("keep")
        assert not holder.loaded and not holder.stub.held

    asyncio.run(scenario())


def test_trainer_delete_checkpoint_reports_the_bytes_freed():
    class Stub:
        async def DeleteCheckpoint(self, request, timeout=None):
            assert isinstance(request, trainer_pb2.DeleteCheckpointFilesRequest)
            assert timeout == SETTINGS.trainer_call_timeout_seconds
            if request.checkpoint_key == "bad":
                raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad checkpoint key 'bad'")
            return trainer_pb2.DeleteCheckpointFilesResponse(freed_bytes=len(request.checkpoint_key))

    handle = TrainerHandle("fake-trainer:1", Stub(), trainer_pb2.ModelInfo(base_model="m"), SETTINGS)
    assert asyncio.run(handle.delete_checkpoint("r/sampler_weights/x")) == len("r/sampler_weights/x")
    with pytest.raises(Exception, match="bad checkpoint key"):
        asyncio.run(handle.delete_checkpoint("bad"))
