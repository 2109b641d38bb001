"""Which sampler serves a request (scheduler/workers/samplers.py), against fake sampler stubs that answer like
the real sampler: adapter affinity within a bound on imbalance, the least loaded sampler for new
adapters and the base model (load = this scheduler's calls in flight, counted around each call), a
call whose sampler is down or dies mid-call made again on another one with the adapter pushed there,
UNAVAILABLE only when every sampler fails, and a restarted sampler's adapters forgotten."""

from __future__ import annotations

import asyncio

import pytest

from temper.common.errors import FailedPrecondition, Unavailable
from temper.scheduler.workers import samplers as routing
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import sampler_pb2
from test_backends_adapters import SETTINGS, FakeTrainer, backends, sampler

TRAINER = FakeTrainer()


def load_for(b, tenant: str = "t"):
    """What the servicer passes as ``load``: push the request's checkpoint from the trainer."""

    def load_key(key: str):
        return lambda s: b.push_checkpoint(TRAINER, s, key, tenant=tenant)

    return load_key


async def sample(b, key: str = "") -> str:
    """One Sample through call_samplers; the incarnation (here: the address) of the sampler that answered."""
    response = await b.call_samplers("m", "Sample", sampler_pb2.SamplerSampleRequest(checkpoint_key=key), load_for(b)(key))
    return response.sequences[0].tokens.decode()


async def until(condition) -> None:
    """Let the other tasks run until ``condition`` holds (a bounded number of turns, no clock)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the calls never got there")


def test_base_model_requests_go_to_the_least_loaded_sampler_and_equal_loads_take_turns():
    a, b_, c = sampler("a:1"), sampler("b:1"), sampler("c:1")
    b = backends(a, b_, c)
    a.in_flight, b_.in_flight, c.in_flight = 2, 0, 1
    assert [b.sampler_for("m") for _ in range(3)] == [b_, b_, b_]
    a.in_flight = b_.in_flight = c.in_flight = 0
    picks = [b.sampler_for("m").address for _ in range(6)]
    assert sorted(picks) == ["a:1", "a:1", "b:1", "b:1", "c:1", "c:1"] and picks[:3] == picks[3:]


def test_concurrent_calls_count_as_load_and_spread():
    a, b_ = sampler("a:1"), sampler("b:1")
    b = backends(a, b_)

    async def scenario():
        gate = asyncio.Event()
        a.stub.gate = b_.stub.gate = gate
        calls = [asyncio.create_task(sample(b)) for _ in range(6)]
        await until(lambda: a.stub.waiting + b_.stub.waiting == 6)
        assert (a.in_flight, b_.in_flight) == (3, 3) and (a.stub.waiting, b_.stub.waiting) == (3, 3)
        gate.set()
        answers = await asyncio.gather(*calls)
        assert sorted(answers) == ["a:1"] * 3 + ["b:1"] * 3
        assert (a.in_flight, b_.in_flight) == (0, 0)  # counted down after the calls

    asyncio.run(scenario())


def test_an_adapter_stays_where_it_is_loaded_within_the_slack_then_spreads():
    settings = SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0", sampler_affinity_slack=2, sampler_retry_seconds=0)
    a, b_ = sampler("a:1", settings), sampler("b:1", settings)
    b = backends(a, b_, settings=settings)

    async def scenario():
        await b.push_checkpoint(TRAINER, b_, "k", tenant="t")
        # B holds k: it serves k while it has at most 2 more calls in flight than A
        for load in (0, 1, 2):
            b_.in_flight = load
            assert b.sampler_for("m", "k") is b_
            assert load == 0 or b.sampler_for("m") is a  # the base model: the least loaded
        assert await sample(b, "k") == "b:1" and "k" not in a.loaded
        b_.in_flight = 3
        assert await sample(b, "k") == "a:1"  # past the slack: A, with k pushed there
        assert a.stub.calls == [("PushAdapter", ""), ("Sample", "k")] and a.loaded == {"k": "t"}
        # held on both: the less loaded holder; equal loads: always the same one (no push, no switching)
        assert await sample(b, "k") == "a:1"
        b_.in_flight = 0
        assert {await sample(b, "k") for _ in range(5)} == {"a:1"}
        a.in_flight = 1
        assert await sample(b, "k") == "b:1"
        assert [c for c in a.stub.calls + b_.stub.calls if c[0] == "PushAdapter"] == [("PushAdapter", "")] * 2

    asyncio.run(scenario())


def test_a_new_adapter_goes_to_the_least_loaded_sampler_and_is_pushed_there():
    a, b_ = sampler("a:1"), sampler("b:1")
    b = backends(a, b_)

    async def scenario():
        a.in_flight = 1
        assert await sample(b, "new") == "b:1"
        assert b_.stub.held == {"new"} and not a.stub.held
        assert b_.stub.calls == [("PushAdapter", ""), ("Sample", "new")]
        a.in_flight = 0
        # equal loads: new adapters in turn, so they spread over the samplers
        homes = {key: await sample(b, key) for key in ("n1", "n2", "n3", "n4")}
        assert sorted(homes.values()) == ["a:1", "a:1", "b:1", "b:1"]

    asyncio.run(scenario())


def test_a_sampler_that_is_down_or_dies_mid_call_is_replaced_with_the_adapter_pushed_there():
    a, b_ = sampler("a:1"), sampler("b:1")
    b = backends(a, b_)

    async def scenario():
        await b.push_checkpoint(TRAINER, a, "k", tenant="t")
        a.stub.down = True  # unreachable
        assert await sample(b, "k") == "b:1"
        assert b_.stub.calls == [("PushAdapter", ""), ("Sample", "k")] and b_.loaded == {"k": "t"}
        assert a.stub.calls == [("PushAdapter", ""), ("Sample", "k")] and a.recheck

        # A is back; a call in flight on it when it dies is made again on B
        fresh, other = sampler("c:1"), sampler("d:1")
        b2 = backends(fresh, other)
        await b2.push_checkpoint(TRAINER, fresh, "k", tenant="t")
        fresh.stub.gate = asyncio.Event()
        call = asyncio.create_task(sample(b2, "k"))
        await until(lambda: fresh.stub.waiting == 1)
        assert fresh.in_flight == 1
        fresh.stub.down = True
        fresh.stub.gate.set()   # the connection drops mid-call
        assert await call == "d:1" and other.stub.held == {"k"}
        assert fresh.in_flight == 0 and other.in_flight == 0
        # the failed sampler is chosen last for a while, even when it is the less loaded one
        fresh.stub.down = False
        other.in_flight = 3
        assert b2.sampler_for("m", "k") is other and b2.sampler_for("m") is other

        # ComputeLogprobs fails over the same way
        e, f = sampler("e:1"), sampler("f:1")
        b3 = backends(e, f)
        await b3.push_checkpoint(TRAINER, e, "k", tenant="t")
        e.stub.down = True
        response = await b3.call_samplers("m", "ComputeLogprobs", sampler_pb2.SamplerLogprobsRequest(checkpoint_key="k"),
                                          load_for(b3)("k"))
        assert isinstance(response, sampler_pb2.ComputeLogprobsResponseInternal)
        assert e.stub.calls[-1] == f.stub.calls[-1] == ("ComputeLogprobs", "k") and f.stub.held == {"k"}

    asyncio.run(scenario())


def test_unavailable_only_when_every_sampler_of_the_model_fails():
    a, b_, c = sampler("a:1"), sampler("b:1"), sampler("c:1")
    b = backends(a, b_, c)

    async def scenario():
        for s in (a, b_, c):
            s.stub.down = True
        with pytest.raises(Unavailable) as raised:
            await sample(b, "k")
        assert all(address in raised.value.message for address in ("a:1", "b:1", "c:1"))
        # each was tried once: the push of k failed on each (nothing reached a Sample)
        assert [len(s.stub.calls) for s in (a, b_, c)] == [1, 1, 1]
        assert all(s.in_flight == 0 and s.recheck for s in (a, b_, c))
        # one comes back: it answers (asked for its model info first), though all were suspect
        b_.stub.down = False
        assert await sample(b, "k") == "b:1" and b_.stub.info_calls == 1 and not b_.recheck
        # an error that is not about reaching the sampler goes to the caller at once: no other sampler is tried
        a.stub.down = c.stub.down = False
        with pytest.raises(FailedPrecondition):
            await b.call_samplers("m", "Sample", sampler_pb2.SamplerSampleRequest(checkpoint_key="gone"))
        assert sum(("Sample", "gone") in s.stub.calls for s in (a, b_, c)) == 1

    asyncio.run(scenario())


def test_a_restarted_sampler_is_found_by_its_incarnation_and_its_adapters_forgotten(monkeypatch):
    monkeypatch.setattr(routing, "SUSPECT_SECONDS", 0.0)  # chosen again at once (the model info is still asked)
    a, b_ = sampler("a:1"), sampler("b:1")
    b = backends(a, b_)

    async def scenario():
        for key in ("k1", "k2"):
            await b.push_checkpoint(TRAINER, a, key, tenant="t")
        # A dies (a call fails over) and comes back as a new process without its adapters
        a.stub.down = True
        assert await sample(b, "k1") == "b:1"
        a.stub.restart("a:2")
        a.stub.down = False
        b_.in_flight = 1
        assert set(a.loaded) == {"k1", "k2"}  # not known yet
        assert await sample(b, "k1") == "a:2"
        assert a.stub.info_calls == 1 and a.info.incarnation == "a:2" and not a.recheck
        assert a.loaded == {"k1": "t"} and a.stub.held == {"k1"}  # k2 forgotten, k1 pushed again
        assert [c[0] for c in a.stub.calls[-2:]] == ["PushAdapter", "Sample"]

        # a restart nobody saw: "not loaded" asks, the new incarnation clears what was pushed before
        await b.push_checkpoint(TRAINER, a, "k3", tenant="t")
        a.stub.restart("a:3")
        assert await sample(b, "k1") == "a:3"
        assert a.loaded == {"k1": "t"} and a.stub.held == {"k1"} and a.info.incarnation == "a:3"

        # the same incarnation: keys the sampler evicted by itself are forgotten, the rest kept
        await b.push_checkpoint(TRAINER, a, "k4", tenant="t")
        a.stub.held.discard("k1")
        assert await sample(b, "k1") == "a:3"
        assert set(a.loaded) == {"k1", "k4"} and a.loaded["k4"] == "t"

    asyncio.run(scenario())


def test_the_save_time_push_target_is_the_least_loaded_sampler_and_settings_default():
    a, b_ = sampler("a:1"), sampler("b:1")
    b = backends(a, b_)
    b_.in_flight = 2
    assert b.sampler_for("m") is a  # loop.py::_save pushes a new checkpoint here
    assert SETTINGS.sampler_affinity_slack == 4
    with pytest.raises(Exception, match="no sampler serves"):
        b.sampler_for("other")


def test_a_call_whose_only_sampler_is_restarting_completes_late_within_sampler_retry_seconds(monkeypatch):
    monkeypatch.setattr(routing, "SUSPECT_SECONDS", 0.0)
    settings = SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0", sampler_retry_seconds=30)
    only = sampler("a:1", settings)
    b = backends(only, settings=settings)

    async def scenario():
        only.stub.down = True  # killed; back a moment later
        call = asyncio.create_task(sample(b, "k"))
        await asyncio.sleep(0.5)
        assert not call.done() and only.stub.info_calls >= 1  # tried again (asked who it is first), not failed
        only.stub.down = False
        assert await asyncio.wait_for(call, 10) == "a:1" and only.stub.held == {"k"}  # the adapter pushed again

    asyncio.run(scenario())
