"""Registered workers as the scheduler keeps them (scheduler/workers/membership.py), against fake worker stubs
and a fake clock: a registration is dialled back before it counts; a new incarnation at a known
address is a restart (a trainer's runs are marked for restore, a sampler forgets its adapters); a
silent trainer that does not answer has its runs failed over; heartbeats of unknown workers answer
NotFound; and the settings that turn the registry on."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from prometheus_client import REGISTRY

from fakes_scheduler import build
from temper.common.errors import FailedPrecondition, NotFound, Unavailable
from temper.scheduler.workers import membership as membership_module
from temper.scheduler.workers.backends import Backends
from temper.scheduler.workers.membership import Membership
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import registry_pb2, sampler_pb2, trainer_pb2, types_pb2

TRAINER, SAMPLER = registry_pb2.WORKER_ROLE_TRAINER, registry_pb2.WORKER_ROLE_SAMPLER


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeWorker:
    """GetModelInfo of a trainer or sampler process: ``incarnation`` changes when it restarts."""

    def __init__(self, role: str, incarnation: str, held: tuple[str, ...] = ()):
        self.role, self.incarnation, self.held, self.down = role, incarnation, list(held), False

    async def GetModelInfo(self, request, timeout=None, wait_for_ready=None):
        if self.down:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if self.role == "trainer":
            return trainer_pb2.ModelInfo(base_model="m", incarnation=self.incarnation)
        return sampler_pb2.SamplerModelInfo(base_model="m", incarnation=self.incarnation, loaded_adapters=self.held)


class FakeRecovery:
    def __init__(self, backends: Backends, moves: bool = True):
        self.backends, self.moves = backends, moves
        self.restarted: list = []
        self.failed_over: list = []

    def trainer_restarted(self, trainer):
        self.restarted.append(trainer)
        return [r for r, a in self.backends.placements.items() if a == trainer.address]

    async def fail_over(self, dead, run_ids):
        self.failed_over.append(dead.address)
        return self.moves


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(monkeypatch):
    """Workers by address; Backends whose channels are the addresses and whose stubs are the workers."""
    workers: dict[str, FakeWorker] = {}
    stub = lambda address: workers[address]  # noqa: E731
    monkeypatch.setattr(membership_module, "STUBS", {"trainer": (stub, trainer_pb2.GetModelInfoRequest()),
                                                     "sampler": (stub, sampler_pb2.SamplerModelInfoRequest())})
    settings = SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0", registry_bind="127.0.0.1:0",
                                 worker_timeout_seconds=10.0)
    backends = Backends(settings)
    backends.channel = lambda address: address
    recovery, clock = FakeRecovery(backends), Clock()
    return workers, backends, recovery, clock, Membership(backends, recovery, settings, clock=clock)


def test_a_registered_trainer_is_dialled_back_and_joins_once(world):
    workers, backends, recovery, clock, members = world

    async def scenario():
        assert not backends.ready
        workers["t1:1"] = FakeWorker("trainer", "a")
        await members.register(TRAINER, "t1:1", "a")
        assert [t.address for t in backends.trainers] == ["t1:1"] and backends.ready
        await asyncio.wait_for(backends.wait_for_new_trainer(), 1)  # the loop is told: it starts a lane
        await members.register(TRAINER, "t1:1", "a")  # again (the worker re-registers): the same handle
        assert len(backends.trainers) == 1 and not recovery.restarted

        workers["t2:1"] = FakeWorker("trainer", "b")
        workers["t2:1"].down = True
        with pytest.raises(Unavailable, match="t2:1"):  # an address the scheduler cannot reach is not added
            await members.register(TRAINER, "t2:1", "b")
        workers["t2:1"].down = False
        with pytest.raises(FailedPrecondition, match="another process"):  # someone else answers there
            await members.register(TRAINER, "t2:1", "not-b")
        assert [t.address for t in backends.trainers] == ["t1:1"]

    asyncio.run(scenario())


def test_a_new_incarnation_is_a_restart_and_its_runs_are_marked_for_restore(world):
    workers, backends, recovery, clock, members = world

    async def scenario():
        workers["t1:1"] = FakeWorker("trainer", "a")
        await members.register(TRAINER, "t1:1", "a")
        handle = backends.trainers[0]
        backends.placements.update({"run-1": "t1:1", "run-2": "elsewhere:1"})
        workers["t1:1"].incarnation = "b"
        await members.register(TRAINER, "t1:1", "b")
        assert recovery.restarted == [handle] and backends.trainers == [handle]  # the same handle: its lane goes on
        assert handle.info.incarnation == "b"
        with pytest.raises(NotFound):  # the old process's late heartbeat
            members.heartbeat(TRAINER, "t1:1", "a")
        members.heartbeat(TRAINER, "t1:1", "b")

    asyncio.run(scenario())


def test_heartbeats_of_unknown_workers_answer_not_found():
    members = Membership(Backends(SchedulerSettings(database_url="sqlite://")), None, SchedulerSettings(database_url="sqlite://"))
    with pytest.raises(NotFound, match="register again"):
        members.heartbeat(TRAINER, "t1:1", "a")
    with pytest.raises(Exception, match="unknown worker role"):
        asyncio.run(members.register(0, "t1:1", "a"))


def test_a_silent_trainer_that_does_not_answer_is_failed_over_once_and_taken_back_when_heard(world):
    workers, backends, recovery, clock, members = world

    async def scenario():
        for address, incarnation in (("t1:1", "a"), ("t2:1", "b")):
            workers[address] = FakeWorker("trainer", incarnation)
            await members.register(TRAINER, address, incarnation)
        clock.now += 6
        members.heartbeat(TRAINER, "t2:1", "b")
        clock.now += 6  # t1 silent for 12 s, t2 for 6 s
        workers["t1:1"].down = True
        await members.sweep()
        assert recovery.failed_over == ["t1:1"] and backends.down == {"t1:1"}
        assert REGISTRY.get_sample_value("temper_scheduler_trainers_down") == 1  # operators see it too
        await members.sweep()
        assert recovery.failed_over == ["t1:1"]  # once per silence
        workers["t1:1"].down = False
        members.heartbeat(TRAINER, "t1:1", "a")  # it was only frozen: heard again, takes new runs again
        assert backends.down == set() and not members.members[("trainer", "t1:1")].down
        assert REGISTRY.get_sample_value("temper_scheduler_trainers_down") == 0

        clock.now += 11  # both silent now, but t2 still answers the scheduler: only its heartbeats are lost
        workers["t1:1"].down = True
        await members.sweep()
        assert recovery.failed_over == ["t1:1", "t1:1"] and backends.down == {"t1:1"}

    asyncio.run(scenario())


def test_a_sampler_restart_forgets_its_adapters_and_a_silent_one_is_chosen_last(world):
    workers, backends, recovery, clock, members = world

    async def scenario():
        workers["s1:1"] = FakeWorker("sampler", "a", held=("k1",))
        await members.register(SAMPLER, "s1:1", "a")
        sampler = backends.samplers[0]
        assert list(sampler.loaded) == ["k1"] and not backends.trainers
        workers["s1:1"].incarnation, workers["s1:1"].held = "b", []  # restarted: a new process, no adapters
        await members.register(SAMPLER, "s1:1", "b")
        assert backends.samplers == [sampler] and not sampler.loaded and sampler.info.incarnation == "b"
        clock.now += 11
        await members.sweep()
        assert sampler.suspect_until == math.inf and sampler.recheck
        members.heartbeat(SAMPLER, "s1:1", "b")
        assert sampler.suspect_until == 0.0

    asyncio.run(scenario())


def test_recovery_marks_the_runs_placed_on_a_restarted_trainer():
    s = build()
    s.loop.backends.placements.update({"run-1": s.trainer.address, "run-2": "other:1"})
    assert s.loop.recovery.trainer_restarted(s.trainer) == ["run-1"]
    assert set(s.loop.recovery.pending) == {"run-1"}
    off = build(recovery="off")
    off.loop.backends.placements["run-1"] = off.trainer.address
    assert off.loop.recovery.trainer_restarted(off.trainer) == [] and not off.loop.recovery.pending


def test_a_registry_drops_the_loopback_default_lists_unless_they_are_set(monkeypatch):
    assert SchedulerSettings().trainer_addresses == ["127.0.0.1:50061"]
    assert SchedulerSettings(registry_bind="0.0.0.0:50081").trainer_addresses == []
    assert SchedulerSettings(registry_bind="0.0.0.0:50081").sampler_addresses == []
    monkeypatch.setenv("TEMPER_SCHEDULER_TRAINER_ADDRESSES", "t:1")
    monkeypatch.setenv("TEMPER_SCHEDULER_REGISTRY_BIND", "0.0.0.0:50081")
    assert SchedulerSettings().trainer_addresses == ["t:1"] and SchedulerSettings().sampler_addresses == []


class FrozenSampler(FakeWorker):
    """A sampler whose Sample never answers (SIGSTOPped: its connection stays open)."""

    waiting = 0

    async def Sample(self, request, timeout=None):
        self.waiting += 1
        await asyncio.Event().wait()


class AnsweringSampler(FakeWorker):
    async def Sample(self, request, timeout=None):
        return types_pb2.SampleResponse(sequences=[types_pb2.SampledSequence(tokens=self.incarnation.encode())])


def test_a_call_waiting_on_a_sampler_marked_down_is_given_up_and_sampled_on_another(world):
    """Issue 21, edge 2, for samplers: without abandonment the call waits out sampler_call_timeout_seconds."""
    workers, backends, recovery, clock, members = world

    async def scenario():
        workers["s1:1"], workers["s2:1"] = FrozenSampler("sampler", "frozen"), AnsweringSampler("sampler", "live")
        await members.register(SAMPLER, "s1:1", "frozen")
        await members.register(SAMPLER, "s2:1", "live")
        frozen = backends.sampler_at("s1:1")
        call = asyncio.create_task(backends.call_samplers("m", "Sample", sampler_pb2.SamplerSampleRequest()))
        while workers["s1:1"].waiting == 0:  # equal loads: the first registered is chosen first
            await asyncio.sleep(0.01)
        assert len(frozen.calls) == 1 and not call.done()
        clock.now += 11
        members.heartbeat(SAMPLER, "s2:1", "live")
        await members.sweep()  # s1 silent past worker_timeout_seconds: down, its waiting call given up
        answer = await asyncio.wait_for(call, timeout=5)
        assert answer.sequences[0].tokens == b"live" and workers["s1:1"].waiting == 1
        assert frozen.suspect_until == math.inf and len(frozen.calls) == 0  # still chosen last until heard again

    asyncio.run(scenario())
