"""The cycles' outcomes are group-committed across lanes (planning/group_commit.FinishWriter): the
finishes handed in while a write is under way go in one transaction, each caller resumes only once
its outcomes are committed, and an outage fails each caller with its own Unavailable (nothing of the
group is written; each lane resends its own)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from temper.common.errors import Unavailable
from temper.scheduler.planning.group_commit import Finish, FinishWriter, merged

def finish(run: str, seqs: list[int], tokens: int, steps: int, ahead: list[int] = ()) -> Finish:
    return Finish([(run, s, "done", None, b"r%d" % s) for s in seqs], {run: tokens}, {run: steps}, {run: max(seqs) + 1},
                  [f"metric {run}#{s}" for s in seqs], [(run, s) for s in ahead])


def test_merged_adds_counters_and_keeps_every_row():
    a = finish("a", [1, 2], 12, 1, ahead=[3])
    b = finish("b", [7], 5, 0)
    c = finish("a", [3], 6, 0)  # a later cycle of run a (same group after a resend)
    m = merged([a, b, c])
    assert m.outcomes == a.outcomes + b.outcomes + c.outcomes
    assert m.tokens == {"a": 18, "b": 5} and m.steps == {"a": 1, "b": 0}
    assert m.next_seq == {"a": 4, "b": 8}
    assert m.metrics == a.metrics + b.metrics + c.metrics and m.running == [("a", 3)]


class RecordingStore:
    """finish_requests as the loop calls it; the first call blocks until released, so the next
    finishes queue up behind it."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.release = threading.Event()
        self.down = False

    def finish_requests(self, outcomes, tokens, steps, next_seq, window, metrics, running):
        if not self.calls:
            self.release.wait(10)
        if self.down:
            raise Unavailable("the database is unavailable (fake)")
        self.calls.append((list(outcomes), dict(tokens), dict(next_seq), window, list(running)))


def test_finishes_of_several_lanes_go_in_one_transaction():
    async def scenario():
        store = RecordingStore()
        writer = FinishWriter(store, result_window=64)
        first = asyncio.create_task(writer.add(finish("a", [1], 6, 0)))
        await asyncio.sleep(0.05)  # the first write is under way (blocked in its thread)
        later = [asyncio.create_task(writer.add(finish(run, [seq], 6, 0))) for run, seq in (("b", 4), ("c", 9))]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in [first, *later])  # nobody resumes before its outcomes are committed
        store.release.set()
        await asyncio.gather(first, *later)
        assert len(store.calls) == 2 and writer.groups == 2
        assert [o[:2] for o in store.calls[1][0]] == [("b", 4), ("c", 9)]  # both later lanes, one transaction
        assert store.calls[1][2] == {"b": 5, "c": 10} and store.calls[1][3] == 64

    asyncio.run(scenario())


def test_an_outage_fails_each_caller_of_the_group_with_its_own_unavailable():
    async def scenario():
        store = RecordingStore()
        store.release.set()
        store.down = True
        writer = FinishWriter(store, result_window=0)
        results = await asyncio.gather(*(writer.add(finish(run, [1], 1, 0)) for run in "ab"), return_exceptions=True)
        assert all(isinstance(r, Unavailable) for r in results) and results[0] is not results[1]
        assert store.calls == []
        store.down = False  # each lane resends its own finish once the database is back
        await asyncio.gather(*(writer.add(finish(run, [1], 1, 0)) for run in "ab"))
        assert sorted(o[0] for call in store.calls for o in call[0]) == ["a", "b"]

    asyncio.run(scenario())


@pytest.mark.parametrize("n", [1, 3])
def test_a_single_finish_is_written_as_it_is(n):
    store = RecordingStore()
    store.release.set()
    writer = FinishWriter(store, result_window=8)
    f = finish("a", list(range(1, n + 1)), 6 * n, 0, ahead=[n + 1])
    assert writer.write_group([f]) == [None]
    outcomes, tokens, next_seq, window, running = store.calls[0]
    assert outcomes == f.outcomes and tokens == {"a": 6 * n} and next_seq == {"a": n + 1} and running == [("a", n + 1)]
    assert window == 8
