"""Admission and the loop in-process, with a fake store and a fake trainer (no model, no network):
dedupe, seq order, limits, honest answers under worker and database faults, gap timeouts under load."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fakes_scheduler import FakeBackends, FakeStore, FakeTrainer, build, fb
from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.scheduler.api.servicer import TemperServicer
from temper.scheduler.planning.work import WorkKind


class AsRunOwner:
    """The servicer, each call made as the tenant that owns the request's run (what the API key would say)."""

    def __init__(self, servicer: TemperServicer, store):
        self.servicer, self.store = servicer, store

    def __getattr__(self, name):
        method = getattr(self.servicer, name)

        async def call(request, context):
            token = set_caller(self.store.tenants.get(request.training_run_id, "nobody"))
            try:
                return await method(request, context)
            finally:
                reset_caller(token)

        return call


def servicer_of(s) -> AsRunOwner:
    return AsRunOwner(TemperServicer(s.store, FakeBackends(s.trainer), s.admission.runs, s.admission), s.store)


@contextlib.asynccontextmanager
async def started(*args, runs: dict[str, str], **kwargs):
    """A scheduler (fake store and trainer) with ``runs`` (run -> tenant), its servicer, and its loop running."""
    s = build(*args, **kwargs)
    for run_id, tenant in runs.items():
        s.store.add_run(run_id, tenant)
    task = asyncio.create_task(s.loop.run_forever())
    await asyncio.sleep(0)
    try:
        yield s, servicer_of(s)
    finally:
        task.cancel()


def test_a_retry_gets_the_first_answer_and_a_different_payload_is_refused():
    async def main():
        async with started(runs={"r": "alice"}) as (s, api):
            first, again = await asyncio.gather(api.ForwardBackward(fb("r", 1), None), api.ForwardBackward(fb("r", 1), None))
            assert first == again and first.metrics["loss:sum"] == 1.0
            assert await api.ForwardBackward(fb("r", 1), None) == first  # after it ran: from memory
            with pytest.raises(AlreadyExists):
                await api.ForwardBackward(fb("r", 1, tokens=(4, 5)), None)
            assert s.trainer.applied == [("r", 1)]

    asyncio.run(main())


def test_the_database_is_asked_only_about_seqs_that_may_have_a_row_memory_lacks():
    async def main():
        async with started(runs={"r": "alice"}, result_cache_size=4) as (s, api):
            # new seqs, even out of order, are not looked up: no row can exist for them
            answers = await asyncio.gather(*[api.ForwardBackward(fb("r", seq), None) for seq in (3, 1, 4, 2)])
            for seq in (5, 6):
                await api.ForwardBackward(fb("r", seq), None)
            assert s.store.lookups == []
            # seqs 3 and 1 have left the in-memory results: a retry gets its answer from its row
            assert await api.ForwardBackward(fb("r", 1), None) == answers[1]
            assert s.store.lookups == [("r", 1)]
            assert s.trainer.applied == [("r", seq) for seq in range(1, 7)]

    asyncio.run(main())


def test_rows_left_by_an_earlier_process_are_looked_up():
    async def main():
        store = FakeStore()
        store.add_run("r", "alice")
        store.add_request("r", 1, "forward_backward", "x", "queued", 3)  # accepted by an earlier process, never answered
        async with started(store=store, runs={}) as (s, api):
            with pytest.raises(AlreadyExists):  # the seq is taken by another payload
                await api.ForwardBackward(fb("r", 1), None)
            assert s.store.lookups == [("r", 1)]

    asyncio.run(main())


def test_bad_input_spends_its_seq_and_writes_nothing():
    async def main():
        async with started(runs={"r": "alice"}) as (s, api):
            later = asyncio.create_task(api.ForwardBackward(fb("r", 2), None))
            with pytest.raises(InvalidArgument, match="outside the vocabulary"):
                await api.ForwardBackward(fb("r", 1, tokens=(1, 500)), None)
            assert (await later).metrics["loss:sum"] == 2.0  # the run went on after the rejected seq
            assert ("r", 1) not in s.store.requests and s.trainer.applied == [("r", 2)]
            with pytest.raises(InvalidArgument):  # a retry of the rejected seq hears the same answer
                await api.ForwardBackward(fb("r", 1, tokens=(1, 500)), None)
            with pytest.raises(AlreadyExists):  # the seq is spent: another payload cannot take it
                await api.ForwardBackward(fb("r", 1), None)

    asyncio.run(main())


def test_a_parked_backlog_counts_against_its_own_run_only():
    async def main():
        limits = {"max_queued_requests": 2, "max_queued_per_tenant": 2, "max_queued_per_run": 10}
        async with started(runs={"a": "alice", "b": "bob"}, **limits) as (s, api):
            parked = [asyncio.create_task(api.ForwardBackward(fb("a", seq), None)) for seq in range(2, 12)]  # behind seq 1
            await asyncio.sleep(0.2)
            with pytest.raises(ResourceExhausted, match="run a has 10 queued requests"):
                await api.ForwardBackward(fb("a", 12), None)
            # bob is admitted and runs although alice holds 10 requests and the scheduler-wide limit is 2
            assert (await api.ForwardBackward(fb("b", 1), None)).metrics["loss:sum"] == 1.0
            assert not any(p.done() for p in parked)
            assert s.admission.depth_by_tenant()["alice"] == (10, 10)
            await api.ForwardBackward(fb("a", 1), None)
            assert [r.metrics["loss:sum"] for r in await asyncio.gather(*parked)] == [float(seq) for seq in range(2, 12)]

    asyncio.run(main())


def test_limits_hold_exactly_under_concurrent_admission():
    async def main():
        # add_request is slow: every submission is inside admission at once; the run limit still holds
        s = build(store=FakeStore(add_delay=0.05), max_queued_per_run=5)
        s.store.add_run("r", "alice")
        api = servicer_of(s)  # no loop: nothing drains the queue
        results = await asyncio.gather(*[asyncio.wait_for(api.ForwardBackward(fb("r", seq), None), 1.0) for seq in range(1, 21)],
                                       return_exceptions=True)
        exhausted = [r for r in results if isinstance(r, ResourceExhausted)]
        assert len(exhausted) == 15 and len(s.admission.queues["r"]) == 5
        assert sorted(seq for _, seq in s.store.requests) == [1, 2, 3, 4, 5]

    asyncio.run(main())


def test_a_database_outage_at_admission_is_unavailable_and_spends_nothing():
    async def main():
        async with started(runs={"r": "alice"}) as (s, api):
            await api.ForwardBackward(fb("r", 1), None)  # the run is loaded
            s.store.down = True
            with pytest.raises(Unavailable):
                await api.ForwardBackward(fb("r", 2), None)
            assert ("r", 2) not in s.admission.recent and 2 not in s.admission.queues["r"].pending
            s.store.down = False
            assert (await api.ForwardBackward(fb("r", 2), None)).metrics["loss:sum"] == 2.0  # the same seq, resent

    asyncio.run(main())


def test_a_database_outage_while_recording_delays_the_answer_and_loses_nothing():
    async def main():
        async with started(trainer=FakeTrainer(delay=0.2), runs={"r": "alice"}) as (s, api):
            call = asyncio.create_task(api.ForwardBackward(fb("r", 1), None))
            await asyncio.sleep(0.1)  # on the trainer now
            s.store.down = True
            await asyncio.sleep(0.5)
            assert not call.done() and s.trainer.applied == [("r", 1)]  # applied; never answered "failed"
            s.store.down = False
            assert (await asyncio.wait_for(call, 10)).metrics["loss:sum"] == 1.0
            assert s.store.statuses("r") == {1: "done"}

    asyncio.run(main())


def test_an_unanswered_cycle_is_resent_then_answered_unavailable_and_the_retry_gets_the_true_outcome():
    async def main():
        unreachable = FakeTrainer(unreachable_for=100)
        async with started(trainer=unreachable, dispatch_retry_seconds=0.5, runs={"r": "alice"}) as (s, api):
            with pytest.raises(Unavailable, match="whether it was applied is not known"):
                await api.ForwardBackward(fb("r", 1), None)
            assert s.trainer.calls >= 2 and s.trainer.applied == [("r", 1)]  # resent, applied once
            assert s.store.statuses("r") == {1: "running"}  # not "failed": it may have been (and was) applied
            s.trainer.unreachable_for = 0
            assert (await api.ForwardBackward(fb("r", 1), None)).metrics["loss:sum"] == 1.0
            assert s.trainer.applied == [("r", 1)] and s.store.statuses("r") == {1: "done"}

    asyncio.run(main())


def test_a_missing_seq_times_out_on_time_under_other_tenants_load():
    async def main():
        busy = FakeTrainer(delay=0.05)
        async with started(trainer=busy, seq_gap_timeout_seconds=0.3, runs={"a": "alice", "b": "bob"}) as (s, api):
            parked = asyncio.create_task(api.ForwardBackward(fb("a", 2), None))  # seq 1 never comes
            since = asyncio.get_running_loop().time()
            seq = 0
            while not parked.done():  # bob keeps the loop busy all the time
                seq += 1
                await api.ForwardBackward(fb("b", seq), None)
                assert asyncio.get_running_loop().time() - since < 5, "the gap was never skipped under load"
            assert parked.result().metrics["loss:sum"] == 2.0
            with pytest.raises(FailedPrecondition, match="stopped waiting"):
                await api.ForwardBackward(fb("a", 1), None)

    asyncio.run(main())


def test_admission_is_one_call_per_verb():
    # Each sequenced verb of the servicer is a few lines that hand over to admission.
    import inspect

    for verb in ("ForwardBackward", "OptimStep", "SaveWeights", "LoadWeights"):
        assert len(inspect.getsource(getattr(TemperServicer, verb)).splitlines()) <= 25, verb
    assert {k.value for k in WorkKind} == {"forward_backward", "forward", "optim_step", "save_weights", "load_weights"}


def test_a_dead_loop_fails_waiting_calls_unavailable_turns_health_off_and_exits(monkeypatch):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from temper.scheduler import app as app_module
    from temper.scheduler.planning import lanes as lanes_module
    from temper.scheduler.app import EXIT_LOOP_FAILED, SchedulerApp
    from temper.v1 import service_pb2_grpc
    from fakes_scheduler import settings

    calls = []

    def broken_plan(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected: the planner has a bug")

    async def main():
        store, trainer = FakeStore(), FakeTrainer()
        store.add_run("r", "alice")
        app = SchedulerApp(settings(), store=store, backends=FakeBackends(trainer))
        await app.start()
        run = asyncio.create_task(app.run())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(50):
                if (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.05)
            watch = health.Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            monkeypatch.setattr(lanes_module, "plan_cycle", broken_plan)
            call = service_pb2_grpc.TemperStub(channel).ForwardBackward(  # waits behind seq 1
                fb("r", 2), timeout=10, metadata=[("authorization", f"Bearer {store.key_of('alice')}")])
            await asyncio.sleep(0.3)
            app.admission.wake.set()  # the loop wakes, plans, dies
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await asyncio.wait_for(run, 10) == EXIT_LOOP_FAILED
        assert calls

    assert app_module.EXIT_LOOP_FAILED != 0
    asyncio.run(main())


def test_a_bad_string_in_a_sequenced_request_is_a_rejection_that_spends_its_seq():
    async def main():
        async with started(runs={"r": "alice"}) as (s, api):
            later = asyncio.create_task(api.ForwardBackward(fb("r", 2), None))
            bad = fb("r", 1)
            bad.loss_fn = "cross_entropy\x00"
            with pytest.raises(InvalidArgument, match="NUL"):
                await api.ForwardBackward(bad, None)
            assert (await asyncio.wait_for(later, 5)).metrics["loss:sum"] == 2.0  # no gap left behind

    asyncio.run(main())


def test_a_closed_sessions_run_takes_no_new_work_but_answers_retries():
    async def main():
        async with started(runs={"r": "alice"}) as (s, api):
            first = await api.ForwardBackward(fb("r", 1), None)
            s.admission.runs.close_session("s-alice")
            assert await api.ForwardBackward(fb("r", 1), None) == first  # a retry of accepted work
            with pytest.raises(FailedPrecondition, match="session of r is closed"):
                await api.ForwardBackward(fb("r", 2), None)
            assert s.trainer.applied == [("r", 1)]

    asyncio.run(main())
