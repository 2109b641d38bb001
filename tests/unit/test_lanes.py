"""The loop with several trainers (fake store and trainers, no network): one lane per trainer, so a
hung trainer holds only its own runs; per-item answers, so a refused run fails alone."""

from __future__ import annotations

import asyncio

import pytest

from fakes_scheduler import FakeBackends, FakeTrainer, build, fb
from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from temper.scheduler.planning.loop import cycle_outcomes
from temper.v1 import service_pb2, trainer_pb2, types_pb2
from test_admission import servicer_of


async def until(predicate) -> None:
    """Wait for ``predicate`` (a guard against hanging, not a time limit under test)."""
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 10)


def optim(run_id: str, seq: int) -> service_pb2.OptimStepRequest:
    return service_pb2.OptimStepRequest(training_run_id=run_id, seq_id=seq,
                                        adam_params=types_pb2.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8))


def two_trainers(runs: dict[str, str], **overrides):
    """A scheduler whose runs ``a*`` are placed on a hung trainer (its gate closed), the others on a free one."""
    hung, free = FakeTrainer("trainer-hung:1", gate=asyncio.Event()), FakeTrainer("trainer-free:1")
    s = build(backends=FakeBackends(hung, free, placement={run: hung if run.startswith("a") else free for run in runs}), **overrides)
    for run_id, tenant in runs.items():
        s.store.add_run(run_id, tenant)
    return s, hung, free


def test_a_hung_trainer_holds_only_the_runs_placed_on_it():
    async def main():
        s, hung, free = two_trainers({"a": "alice", "b": "bob", "b2": "alice"})
        api = servicer_of(s)
        loop = asyncio.create_task(s.loop.run_forever())
        stuck = asyncio.create_task(api.ForwardBackward(fb("a", 1), None))
        await until(lambda: hung.waiting == 1)  # alice's cycle is on the hung trainer
        # meanwhile the other trainer's runs go on, cycle after cycle, alice's other run among them
        for seq in (1, 2, 3):
            out = await asyncio.wait_for(api.ForwardBackward(fb("b", seq), None), 10)
            assert out.metrics["loss:sum"] == seq
        assert (await asyncio.wait_for(api.ForwardBackward(fb("b2", 1), None), 10)).metrics["loss:sum"] == 1.0
        assert (await asyncio.wait_for(api.OptimStep(optim("b", 4), None), 10)).metrics["step:max"] == 4.0
        assert free.applied == [("b", 1), ("b", 2), ("b", 3), ("b2", 1), ("b", 4)]
        assert not stuck.done() and hung.applied == [] and s.store.statuses("a") == {1: "running"}
        later = asyncio.create_task(api.ForwardBackward(fb("a", 2), None))  # queued behind the hung cycle
        hung.gate.set()
        assert (await asyncio.wait_for(stuck, 10)).metrics["loss:sum"] == 1.0
        assert (await asyncio.wait_for(later, 10)).metrics["loss:sum"] == 2.0
        assert hung.applied == [("a", 1), ("a", 2)] and s.store.statuses("a") == {1: "done", 2: "done"}
        loop.cancel()

    asyncio.run(main())


def test_an_unanswering_trainer_is_resent_to_while_the_other_trainers_runs_go_on():
    async def main():
        s, hung, free = two_trainers({"a": "alice", "b": "bob"}, dispatch_retry_seconds=600)
        hung.gate, hung.unreachable_for = None, 1000  # applies, then its answer is lost, every time
        api = servicer_of(s)
        loop = asyncio.create_task(s.loop.run_forever())
        lost = asyncio.create_task(api.ForwardBackward(fb("a", 1), None))
        await until(lambda: hung.calls >= 2)  # being resent (for dispatch_retry_seconds)
        for seq in (1, 2):
            assert (await asyncio.wait_for(api.ForwardBackward(fb("b", seq), None), 10)).metrics["loss:sum"] == seq
        assert not lost.done() and hung.applied == [("a", 1)]
        assert s.store.statuses("b") == {1: "done", 2: "done"} and s.store.statuses("a") == {1: "running"}
        loop.cancel()
        lost.cancel()

    asyncio.run(main())


def test_a_lane_that_dies_stops_the_loop_and_the_other_lanes():
    async def main():
        s, hung, free = two_trainers({"a": "alice", "b": "bob"})
        api = servicer_of(s)

        async def broken(request):
            raise RuntimeError("injected: a bug on the free trainer's side")

        free.run_cycle = broken
        loop = asyncio.create_task(s.loop.run_forever())
        stuck = asyncio.create_task(api.ForwardBackward(fb("a", 1), None))
        await until(lambda: hung.waiting == 1)
        asyncio.create_task(api.ForwardBackward(fb("b", 1), None))
        with pytest.raises(ExceptionGroup) as raised:  # app.py fails the waiting calls over and exits
            await asyncio.wait_for(loop, 10)
        assert raised.value.subgroup(RuntimeError) is not None
        await until(lambda: hung.waiting == 0)  # the hung trainer's lane was cancelled with the loop
        assert not stuck.done()
        stuck.cancel()

    asyncio.run(main())


def test_work_of_a_run_whose_trainer_is_not_reached_is_answered_unavailable_and_the_lanes_go_on():
    async def main():
        trainer = FakeTrainer()
        s = build(backends=FakeBackends(trainer, placement={"x": None}))
        s.store.add_run("x", "alice")
        s.store.add_run("b", "bob")
        api = servicer_of(s)
        loop = asyncio.create_task(s.loop.run_forever())
        with pytest.raises(Unavailable, match="does not reach; retry; nothing was applied"):
            await asyncio.wait_for(api.ForwardBackward(fb("x", 1), None), 10)
        assert (await asyncio.wait_for(api.ForwardBackward(fb("b", 1), None), 10)).metrics["loss:sum"] == 1.0
        assert trainer.applied == [("b", 1)] and s.store.statuses("x") == {1: "queued"}
        s.loop.backends.placement["x"] = trainer  # reachable again: the resent seq runs on its row
        assert (await asyncio.wait_for(api.ForwardBackward(fb("x", 1), None), 10)).metrics["loss:sum"] == 1.0
        assert s.store.statuses("x") == {1: "done"} and not loop.done()
        loop.cancel()

    asyncio.run(main())


def test_a_refused_run_fails_alone_and_its_co_batched_neighbour_gets_its_own_answers():
    """With trainer recovery off, a lost adapter fails its run's work (with it on: test_recovery.py)."""
    async def main():
        gone = NotFound("the adapter of run a is not loaded on this trainer")
        trainer = FakeTrainer(refuse={"a": gone})
        s = build(trainer=trainer, recovery="off")
        s.store.add_run("a", "alice")
        s.store.add_run("b", "bob")
        api = servicer_of(s)
        calls = [asyncio.create_task(api.ForwardBackward(fb("a", 1), None)), asyncio.create_task(api.OptimStep(optim("a", 2), None)),
                 asyncio.create_task(api.ForwardBackward(fb("b", 1), None)), asyncio.create_task(api.OptimStep(optim("b", 2), None))]
        await until(lambda: sum(len(works) for works in s.admission.ready().values()) == 4)  # all queued: one cycle
        loop = asyncio.create_task(s.loop.run_forever())
        a_fb, a_step, b_fb, b_step = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        assert trainer.calls == 1  # co-batched
        for failed in (a_fb, a_step):  # a run the scheduler knows: its lost adapter is a precondition, not an unknown id
            assert isinstance(failed, FailedPrecondition) and "is gone from trainer" in failed.message
            assert gone.message in failed.message
        assert b_fb.metrics["loss:sum"] == 1.0 and b_step.metrics["step:max"] == 2.0
        assert trainer.applied == [("b", 1), ("b", 2)]
        assert s.store.statuses("a") == {1: "failed", 2: "failed"} and gone.message in s.store.requests[("a", 1)].error
        assert s.store.statuses("b") == {1: "done", 2: "done"}
        assert service_pb2.OptimStepResponse.FromString(s.store.requests[("b", 2)].result) == b_step  # kept for retries
        # the refused run goes on with its next seqs once the trainer takes it again
        trainer.refuse.clear()
        assert (await asyncio.wait_for(api.ForwardBackward(fb("a", 3), None), 10)).metrics["loss:sum"] == 3.0
        loop.cancel()

    asyncio.run(main())


def test_cycle_outcomes_map_each_status_to_its_item():
    response = trainer_pb2.CycleResponse(
        forward_backward=[types_pb2.ForwardBackwardOutput(metrics={"loss:sum": 1.0}), types_pb2.ForwardBackwardOutput()],
        optim_step=[trainer_pb2.OptimStepResponseInternal(metrics={"step:max": 1.0})],
        forward_backward_status=[trainer_pb2.ItemStatus(), trainer_pb2.ItemStatus(code=3, message="bad datum")],
        optim_step_status=[trainer_pb2.ItemStatus()])
    ok, refused, step = cycle_outcomes(response, 2, 1)
    assert ok.metrics["loss:sum"] == 1.0 and step.metrics["step:max"] == 1.0
    assert isinstance(refused, InvalidArgument) and refused.message == "bad datum"
    del response.forward_backward_status[:], response.optim_step_status[:]  # no statuses: every item ran
    assert all(not isinstance(o, Exception) for o in cycle_outcomes(response, 2, 1))
    with pytest.raises(Exception, match="answered a cycle of 3 passes"):
        cycle_outcomes(response, 3, 1)


def test_the_next_cycle_is_marked_running_with_the_previous_ones_outcomes():
    """A run's queued work that makes its next cycle is marked running in the transaction that records
    the cycle before (finish_requests' ``running``), so that cycle sends no mark of its own; work that
    arrives later is marked as before. Every request is marked exactly once, before it is answered."""
    async def main():
        s, hung, _ = two_trainers({"a": "alice"})
        marked: list[tuple[str, int]] = []
        mark = s.store.mark_running
        s.store.mark_running = lambda keys: (marked.extend(keys), mark(keys))
        api = servicer_of(s)
        loop = asyncio.create_task(s.loop.run_forever())
        first = asyncio.create_task(api.ForwardBackward(fb("a", 1), None))
        await until(lambda: hung.waiting == 1)  # cycle 1 (seq 1) is on the trainer
        queued = [asyncio.create_task(api.OptimStep(optim("a", 2), None)), asyncio.create_task(api.ForwardBackward(fb("a", 3), None))]
        await until(lambda: s.store.statuses("a").get(3) == "queued")
        hung.gate.set()
        await asyncio.wait_for(asyncio.gather(first, *queued), 10)
        last = await asyncio.wait_for(api.OptimStep(optim("a", 4), None), 10)  # arrives with nothing of its run queued
        assert last.metrics["step:max"] == 4.0
        # seq 2 (the optim step that ends the run's next cycle) was marked with cycle 1's outcomes
        assert s.store.marked_ahead[0] == ("a", 2)
        assert sorted(marked + s.store.marked_ahead) == [("a", 1), ("a", 2), ("a", 3), ("a", 4)]
        assert hung.applied == [("a", 1), ("a", 2), ("a", 3), ("a", 4)]
        assert s.store.statuses("a") == {1: "done", 2: "done", 3: "done", 4: "done"}
        loop.cancel()

    asyncio.run(main())
