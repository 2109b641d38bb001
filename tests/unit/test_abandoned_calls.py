"""Every scheduler call to a trainer can be given up (issue 21, edge 2): a trainer frozen (SIGSTOP)
mid-snapshot, mid-restore or mid-anything holds its runs only until they move to another trainer
(Recovery.fail_over); then the waiting call raises Abandoned and the run's work is answered by the
new trainer, exactly once, while the frozen one is still frozen."""

from __future__ import annotations

import asyncio

import pytest

from fakes_scheduler import FakeBackends, FakeTrainer, build, fb
from temper.common.errors import Abandoned
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.workers.backends import TrainerHandle
from temper.v1 import trainer_pb2
from test_admission import servicer_of
from test_lanes import until
from test_recovery import answers, train, trained


class FrozenStub:
    """A trainer stub whose every call waits forever (a SIGSTOPped trainer keeps its connection)."""

    def __init__(self):
        self.waiting = 0

    def __getattr__(self, method):
        async def hang(request, timeout=None, metadata=None):
            self.waiting += 1
            await asyncio.Event().wait()
        return hang

    def ReadCheckpoint(self, request, timeout=None):
        async def chunks():
            self.waiting += 1
            await asyncio.Event().wait()
            yield
        return chunks()


CALLS = {
    "run_cycle": lambda t: t.run_cycle(trainer_pb2.CycleRequest()),
    "snapshot": lambda t: t.snapshot("a", "a/snapshots/1-t"),
    "restore": lambda t: t.restore("a", "a/snapshots/1-t"),
    "save": lambda t: t.call("SaveAdapter", trainer_pb2.SaveAdapterRequest(training_run_id="a", checkpoint_key="a/weights/x")),
    "load": lambda t: t.call("LoadAdapter", trainer_pb2.LoadAdapterRequest(training_run_id="a", checkpoint_key="a/weights/x")),
    "drop": lambda t: t.call("DropAdapter", trainer_pb2.DropAdapterRequest(training_run_id="a")),
    "import": lambda t: t.import_adapter("a/weights/x", {"adapter_config.json": b"{}"}),
    "read": lambda t: _read_all(t),
}


async def _read_all(trainer):
    return [chunk async for chunk in trainer.read_checkpoint("a/weights/x")]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_trainer_call_waiting_on_a_frozen_trainer_is_given_up_by_abandon(name):
    async def main():
        stub = FrozenStub()
        handle = TrainerHandle("t-frozen:1", stub, trainer_pb2.ModelInfo(base_model="m"), SchedulerSettings())
        call = asyncio.create_task(CALLS[name](handle))
        await until(lambda: stub.waiting == 1)
        assert handle.abandon() == 1
        with pytest.raises(Abandoned, match="t-frozen:1 stopped answering"):
            await asyncio.wait_for(call, 5)
        assert len(handle.calls) == 0 and handle.abandon() == 0  # nothing left waiting; later calls are not affected

    asyncio.run(main())


def test_a_caller_cancelled_while_waiting_is_cancelled_not_abandoned():
    async def main():
        handle = TrainerHandle("t-frozen:1", FrozenStub(), trainer_pb2.ModelInfo(base_model="m"), SchedulerSettings())
        call = asyncio.create_task(handle.snapshot("a", "a/snapshots/1-t"))
        await until(lambda: len(handle.calls) == 1)
        call.cancel()  # a lane stopping
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())


def two_trainers(frozen_in, **overrides):
    shared = {}  # the trainers' checkpoint store
    frozen = FakeTrainer("t-frozen:1", adapters={}, store=shared, gate=asyncio.Event(), frozen_in=frozen_in)
    alive = FakeTrainer("t-alive:1", adapters={}, store=shared)
    s = build(backends=FakeBackends(frozen, alive, placement={"a": frozen}), dispatch_retry_seconds=600, **overrides)
    s.store.add_run("a", "alice")
    frozen.adapters["a"] = []
    return s, frozen, alive, servicer_of(s)


def test_a_trainer_frozen_in_a_snapshot_holds_its_run_only_until_the_run_moves():
    async def main():
        s, frozen, alive, api = two_trainers(("snapshot",), snapshot_every_steps=1)
        loop = asyncio.create_task(s.loop.run_forever())
        assert answers(await train(api, "a", (1, 2))) == [1.0, 2.0]  # answered; then the snapshot freezes
        await until(lambda: frozen.waiting == 1)
        third = asyncio.create_task(api.ForwardBackward(fb("a", 3), None))
        frozen.down = True  # silent: membership's sweep fails it over
        assert await s.loop.recovery.fail_over(frozen, ())
        assert answers([await asyncio.wait_for(third, 5)]) == [3.0]
        assert not frozen.gate.is_set()  # answered while the trainer is still frozen
        assert alive.adapters["a"] == trained(3) and s.store.statuses("a") == {1: "done", 2: "done", 3: "done"}
        assert s.store.runs["a"].snapshot_key is None  # the abandoned snapshot was never recorded
        frozen.gate.set()  # SIGCONT
        assert answers(await train(api, "a", (4,))) == [4.0] and alive.adapters["a"] == trained(4)
        loop.cancel()

    asyncio.run(main())


def test_a_trainer_frozen_in_a_restore_gives_the_run_up_to_the_trainer_it_moved_to():
    async def main():
        s, frozen, alive, api = two_trainers(("restore",), snapshot_every_steps=2)
        loop = asyncio.create_task(s.loop.run_forever())
        await train(api, "a", (1, 2, 3, 4))
        await until(lambda: s.store.runs["a"].snapshot_key is not None)  # the snapshot follows the answer
        assert s.store.runs["a"].snapshot_key == "a/snapshots/4-t"
        frozen.lose()
        s.loop.recovery.trainer_restarted(frozen)  # a new incarnation registered: "a" is restored first ...
        fifth = asyncio.create_task(api.ForwardBackward(fb("a", 5), None))
        await until(lambda: frozen.waiting == 1)  # ... and the trainer freezes in that restore
        frozen.down = True
        assert await s.loop.recovery.fail_over(frozen, ())
        assert answers([await asyncio.wait_for(fifth, 5)]) == [5.0]
        assert not frozen.gate.is_set() and alive.adapters["a"] == trained(5)
        frozen.gate.set()  # SIGCONT: the given-up restore does not go on there
        assert answers(await train(api, "a", (6,))) == [6.0] and alive.adapters["a"] == trained(6)
        assert not any(entry[0] in ("restore", "create") for entry in frozen.log) and "a" not in frozen.adapters
        loop.cancel()

    asyncio.run(main())
