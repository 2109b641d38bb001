"""Trainer recovery with fake trainers that hold adapters (fakes_scheduler.FakeTrainer(adapters=...)):
a trainer that lost its adapters, or died while another answers, has each run rebuilt from its
snapshot (or a fresh adapter of its seed) and the logged requests since replayed in seq order before
the held work runs; nothing is applied twice, and a run whose log has a hole is refused clearly."""

from __future__ import annotations

import asyncio

import pytest

from fakes_scheduler import FakeBackends, FakeStore, FakeTrainer, build, fb
from temper.common.errors import FailedPrecondition
from temper.scheduler.planning.recovery import _batches
from temper.scheduler.db.request_log import LoggedRequest
from temper.v1 import service_pb2
from test_admission import servicer_of
from test_lanes import optim, until


def applied(*pairs):
    """The state an adapter holds after these (kind, seq) were applied once each, in order."""
    return [("fb" if kind == "fb" else "step", seq) for kind, seq in pairs]


def trained(upto: int):
    """fb at odd seqs, optim_step at even ones, 1..upto."""
    return applied(*(("fb" if seq % 2 else "step", seq) for seq in range(1, upto + 1)))


async def train(api, run_id: str, seqs) -> list:
    """fb at odd seqs, optim_step at even ones, all submitted at once; their answers."""
    calls = [api.ForwardBackward(fb(run_id, seq), None) if seq % 2 else api.OptimStep(optim(run_id, seq), None) for seq in seqs]
    return await asyncio.wait_for(asyncio.gather(*calls), 10)


def one_trainer(**overrides):
    trainer = FakeTrainer(adapters={})
    s = build(trainer=trainer, **overrides)
    for run_id in ("a", "b"):
        s.store.add_run(run_id, "alice")
        trainer.adapters[run_id] = []
    return s, trainer, servicer_of(s)


def answers(outputs) -> list[float]:
    return [o.metrics.get("loss:sum", o.metrics.get("step:max")) for o in outputs]


def test_a_restarted_trainer_gets_the_snapshot_and_the_requests_since_then_the_held_work():
    async def main():
        s, trainer, api = one_trainer(snapshot_every_steps=2)
        loop = asyncio.create_task(s.loop.run_forever())
        for pair in ((1, 2), (3, 4), (5, 6)):
            assert answers(await train(api, "a", pair)) == list(map(float, pair))
        assert s.store.runs["a"].snapshot_key == "a/snapshots/4-t" and s.store.runs["a"].snapshot_seq == 4
        assert ("delete", "a/snapshots/4-t") not in trainer.log and "a/snapshots/4-t" in trainer.store
        # the payloads the snapshot covers are gone, the later ones kept
        assert [seq for (run, seq), r in sorted(s.store.requests.items()) if run == "a" and r.payload] == [5, 6]

        trainer.lose()  # SIGKILL and restart: a new process without adapters
        del trainer.log[:]
        assert answers(await train(api, "a", (7, 8))) == [7.0, 8.0]  # late, not failed
        # 2 steps since the last snapshot: the next one replaces it, whose files are deleted
        await until(lambda: ("delete", "a/snapshots/4-t") in trainer.log)
        restored = trainer.log.index(("restore", "a", "a/snapshots/4-t"))
        assert restored >= 1 and all(e[0] == "cycle" for e in trainer.log[:restored])  # refused: no adapter
        assert trainer.log[restored + 1] == ("cycle", [("a", 5), ("a", 6)])         # the replay, in seq order
        *held, snapshot, delete = trainer.log[restored + 2:]                         # then the held work
        assert [pair for entry in held for pair in entry[1]] == [("a", 7), ("a", 8)]
        assert (snapshot, delete) == (("snapshot", "a", "a/snapshots/8-t"), ("delete", "a/snapshots/4-t"))
        assert trainer.adapters["a"] == trained(8)  # nothing applied twice
        assert s.store.statuses("a") == {seq: "done" for seq in range(1, 9)}
        assert s.store.runs["a"].snapshot_key == "a/snapshots/8-t" and set(trainer.store) == {"a/snapshots/8-t"}
        loop.cancel()

    asyncio.run(main())


def test_a_run_without_a_snapshot_is_created_again_from_its_seed_and_replayed_from_seq_1():
    async def main():
        s, trainer, api = one_trainer()  # snapshot_every_steps 10: none yet
        loop = asyncio.create_task(s.loop.run_forever())
        await train(api, "a", (1, 2, 3, 4))
        await train(api, "b", (1, 2))
        trainer.lose()
        del trainer.log[:]
        assert (await asyncio.wait_for(api.ForwardBackward(fb("a", 5), None), 10)).metrics["loss:sum"] == 5.0
        assert (await asyncio.wait_for(api.ForwardBackward(fb("b", 3), None), 10)).metrics["loss:sum"] == 3.0
        assert trainer.log == [("cycle", [("a", 5)]), ("create", "a", 0),  # its stored config and seed
                               ("cycle", [("a", 1), ("a", 2)]), ("cycle", [("a", 3), ("a", 4)]), ("cycle", [("a", 5)]),
                               ("cycle", [("b", 3)]), ("create", "b", 0), ("cycle", [("b", 1), ("b", 2)]), ("cycle", [("b", 3)])]
        assert trainer.adapters["a"] == trained(5) and trainer.adapters["b"] == trained(3)
        loop.cancel()

    asyncio.run(main())


def test_work_in_flight_when_the_trainer_dies_is_held_and_runs_once_after_the_restore():
    async def main():
        s, trainer, api = one_trainer(dispatch_retry_seconds=600)
        loop = asyncio.create_task(s.loop.run_forever())
        await train(api, "a", (1, 2))
        trainer.down = True  # killed: the cycle is resent while it is away
        in_flight = asyncio.create_task(api.ForwardBackward(fb("a", 3), None))
        await until(lambda: trainer.calls >= 4)
        assert not in_flight.done() and s.store.statuses("a")[3] == "running"
        trainer.lose()
        trainer.down = False  # back on the same address, without adapters
        assert (await asyncio.wait_for(in_flight, 10)).metrics["loss:sum"] == 3.0
        assert trainer.adapters["a"] == trained(3)
        assert s.store.statuses("a") == {1: "done", 2: "done", 3: "done"}
        loop.cancel()

    asyncio.run(main())


def test_the_runs_of_a_trainer_that_stays_down_move_to_one_that_answers_and_go_on_exactly():
    async def main():
        shared = {}  # the trainers' checkpoint store
        dead, alive = FakeTrainer("t-dead:1", adapters={}, store=shared), FakeTrainer("t-alive:1", adapters={}, store=shared)
        s = build(backends=FakeBackends(dead, alive, placement={"a": dead, "b": alive}), snapshot_every_steps=1,
                  dispatch_retry_seconds=0.3)
        for run_id, trainer in (("a", dead), ("b", alive)):
            s.store.add_run(run_id, "alice")
            trainer.adapters[run_id] = []
        api = servicer_of(s)
        loop = asyncio.create_task(s.loop.run_forever())
        await train(api, "a", (1, 2, 3))
        await train(api, "b", (1, 2))
        dead.down = True
        out = await train(api, "a", (4, 5))
        assert answers(out) == [4.0, 5.0]
        assert s.loop.backends.placements["a"] == "t-alive:1" and s.store.runs["a"].trainer == "t-alive:1"  # durably
        assert s.loop.backends.down == {"t-dead:1"}
        assert [e for e in alive.log if e[0] in ("restore", "create") or (e[0] == "cycle" and e[1][0][0] == "a")] == [
            ("restore", "a", "a/snapshots/2-t"), ("cycle", [("a", 3)]), ("cycle", [("a", 4)]), ("cycle", [("a", 5)])]
        assert alive.adapters["a"] == trained(5) and dead.adapters["a"] == trained(3)
        assert answers(await train(api, "b", (3,))) == [3.0]  # the other run went on where it was
        dead.down = False
        await until(lambda: not s.loop.backends.down)  # watched: it takes new runs again
        assert "a" not in dead.adapters and "b" not in dead.adapters  # its stale copy of the moved run is dropped
        loop.cancel()

    asyncio.run(main())


def test_a_run_whose_log_has_a_hole_is_refused_naming_its_last_durable_state():
    async def main():
        s, trainer, api = one_trainer(snapshot_every_steps=2)
        loop = asyncio.create_task(s.loop.run_forever())
        await train(api, "a", (1, 2, 3, 4, 5))
        s.store.requests[("a", 5)].payload = None  # e.g. logged before recovery was turned on
        trainer.lose()
        with pytest.raises(FailedPrecondition, match=r"cannot be restored exactly: the request log has no payload of seq 5.*"
                                                     r"its snapshot after seq 4"):
            await asyncio.wait_for(api.OptimStep(optim("a", 6), None), 10)
        with pytest.raises(FailedPrecondition, match="cannot be restored exactly"):  # and so are its later requests
            await asyncio.wait_for(api.ForwardBackward(fb("a", 7), None), 10)
        assert "a" not in trainer.adapters and s.store.statuses("a")[6] == "failed"
        # a run without a seed and without a snapshot cannot be created again either
        s.store.add_run("c", "alice", seed=None)
        with pytest.raises(FailedPrecondition, match="no snapshot and no seed.*its creation"):
            await asyncio.wait_for(api.ForwardBackward(fb("c", 1), None), 10)
        loop.cancel()

    asyncio.run(main())


def test_a_load_is_replayed_as_a_load_and_replays_are_batched_per_optim_step():
    async def main():
        s, trainer, api = one_trainer()
        load = service_pb2.LoadWeightsRequest(training_run_id="a", seq_id=2, path="tinker://x:train:0/weights/w")
        for seq, kind, payload in ((1, "forward_backward", fb("a", 1)), (2, "load_weights", load), (3, "optim_step", optim("a", 3)),
                                   (4, "save_weights", None), (5, "forward", None)):
            s.store.add_request("a", seq, kind, "sha", "done", 3, None, payload.SerializeToString() if payload else None)
        trainer.lose()
        await s.loop.recovery.restore(trainer, "a", 5)
        assert trainer.log == [("create", "a", 0), ("cycle", [("a", 1)]), ("load", "a", "x:train:0/weights/w"), ("cycle", [("a", 3)])]

    asyncio.run(main())


def test_replay_batches_end_at_each_optim_step_and_keep_to_the_token_budget():
    log = [LoggedRequest(seq, kind, "done", tokens, b"") for seq, kind, tokens in (
        (1, "forward_backward", 60), (2, "forward_backward", 60), (3, "optim_step", 0), (4, "forward_backward", 10),
        (5, "load_weights", 0), (6, "forward_backward", 10), (7, "optim_step", 0))]
    assert [[r.seq_id for r in batch] for batch in _batches(log, 100)] == [[1], [2, 3], [4], [5], [6, 7]]


def test_a_trainer_that_restarts_again_mid_restore_gets_the_whole_restore_again():
    async def main():
        s, trainer, api = one_trainer(snapshot_every_steps=2)
        loop = asyncio.create_task(s.loop.run_forever())
        for pair in ((1, 2), (3, 4), (5, 6)):
            await train(api, "a", pair)
        trainer.lose()
        real_restore, restores = trainer.restore, []

        async def restore_then_restart_again(run_id, key):
            out = await real_restore(run_id, key)
            restores.append(key)
            if len(restores) == 1:
                trainer.lose()  # killed and back again between the snapshot and the replay
            return out
        trainer.restore = restore_then_restart_again
        assert answers(await train(api, "a", (7, 8))) == [7.0, 8.0]  # not FAILED_PRECONDITION: restored again
        assert restores == ["a/snapshots/4-t", "a/snapshots/4-t"] and trainer.adapters["a"] == trained(8)
        loop.cancel()

    asyncio.run(main())


def test_retries_while_the_trainer_is_unreachable_do_not_count_as_restores():
    async def main():
        s, trainer, api = one_trainer(snapshot_every_steps=2, dispatch_retry_seconds=30)
        loop = asyncio.create_task(s.loop.run_forever())
        for pair in ((1, 2), (3, 4)):
            await train(api, "a", pair)
        trainer.lose()
        s.loop.recovery.trainer_restarted(trainer)  # its new incarnation registered: "a" is pending
        trainer.down = True                          # ... and it is unreachable for a while (more retries than MAX_RESTORES)
        call = asyncio.create_task(train(api, "a", (5,)))
        await asyncio.sleep(2.0)
        trainer.down = False
        assert answers(await call) == [5.0]
        assert trainer.adapters["a"] == trained(5)
        loop.cancel()

    asyncio.run(main())


def test_a_frozen_trainers_cycle_is_abandoned_when_its_run_moves_and_runs_once_on_the_new_trainer():
    async def main():
        shared = {}
        frozen = FakeTrainer("t-dead:1", adapters={}, store=shared, gate=asyncio.Event())  # SIGSTOPped mid-cycle
        alive = FakeTrainer("t-alive:1", adapters={}, store=shared)
        s = build(backends=FakeBackends(frozen, alive, placement={"a": frozen}), dispatch_retry_seconds=600)
        s.store.add_run("a", "alice")
        frozen.adapters["a"] = []
        api = servicer_of(s)
        loop = asyncio.create_task(s.loop.run_forever())
        first = asyncio.create_task(api.ForwardBackward(fb("a", 1), None))
        await until(lambda: frozen.waiting == 1)
        second = asyncio.create_task(api.OptimStep(optim("a", 2), None))  # pipelined by the client
        await asyncio.sleep(0.05)
        assert not second.done()  # seq 1 is still on the frozen trainer
        frozen.down = True  # silent: membership's sweep fails it over
        assert await s.loop.recovery.fail_over(frozen, ())
        # the frozen call is abandoned: seq 1 runs on the new trainer (not skipped as "running"), then seq 2
        assert answers([await asyncio.wait_for(first, 5), await asyncio.wait_for(second, 5)]) == [1.0, 2.0]
        assert alive.adapters["a"] == trained(2) and s.store.statuses("a") == {1: "done", 2: "done"}
        frozen.gate.set()  # SIGCONT: whatever it applies now is on a copy nobody uses
        assert answers(await train(api, "a", (3,))) == [3.0] and alive.adapters["a"] == trained(3)
        loop.cancel()

    asyncio.run(main())


def test_a_restore_cut_short_by_a_scheduler_crash_is_done_again_by_the_next_process():
    async def main():
        store, trainer = FakeStore(), FakeTrainer(adapters={})
        s = build(store=store, trainer=trainer, snapshot_every_steps=2)
        store.add_run("a", "alice")
        trainer.adapters["a"] = []
        api = servicer_of(s)
        loop = asyncio.create_task(s.loop.run_forever())
        for pair in ((1, 2), (3, 4), (5, 6)):
            await train(api, "a", pair)
        trainer.lose()
        real_restore = trainer.restore

        async def restore_then_the_scheduler_dies(run_id, key):
            await real_restore(run_id, key)
            loop.cancel()  # SIGKILL after RestoreAdapter, before the replay of seqs 5 and 6
            await asyncio.sleep(3600)
        trainer.restore = restore_then_the_scheduler_dies
        resent = asyncio.create_task(api.ForwardBackward(fb("a", 7), None))
        await until(loop.done)
        resent.cancel()
        assert trainer.adapters["a"] == trained(4) and store.runs["a"].restoring  # half-built, and the mark says so
        trainer.restore = real_restore
        store.runs["a"].next_seq_id = 7
        s2 = build(store=store, trainer=trainer, snapshot_every_steps=2)  # the next scheduler process, same database
        loop2 = asyncio.create_task(s2.loop.run_forever())
        assert answers([await asyncio.wait_for(servicer_of(s2).ForwardBackward(fb("a", 7), None), 5)]) == [7.0]
        assert trainer.adapters["a"] == trained(7) and not store.runs["a"].restoring  # 5 and 6 replayed, not skipped
        loop2.cancel()

    asyncio.run(main())


@pytest.mark.real_snapshot_tokens
def test_every_snapshot_attempt_has_a_key_of_its_own():
    """A snapshot a frozen trainer finishes after the call was given up (and then deletes) never has the
    key of the one taken again at the same seq and recorded."""
    from temper.scheduler.planning.recovery import snapshot_key

    keys = {snapshot_key("a", 4) for _ in range(32)}
    assert len(keys) == 32 and all(k.startswith("a/snapshots/4-") for k in keys)
