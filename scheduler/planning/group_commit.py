"""Group commit: what callers hand in while the previous write is under way (or in the same
event-loop tick) goes to the database together, in one transaction, instead of one transaction
and commit each. Nothing is acknowledged earlier than before: each caller resumes only once its
part is committed, and hears its own outcome (a database outage fails the whole group, each
caller with its own Unavailable).

Two writers on the hot path, each its own transactions:
- ``RequestWriter``: admitted request rows, with the lanes' "running" marks (a cycle's work, before
  it goes to its trainer: its runs' dispatched watermarks, one run row each, ``request_log.py``).
- ``FinishWriter``: the cycles' outcomes, of every lane whose cycle ended meanwhile. Outcomes are
  not in the request writer's transactions: there they waited behind the admissions' commits and
  the scheduler sat idle (benchmarks/README.md, scaleout).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Generic, NamedTuple, TypeVar

from temper.common.errors import TemperError
from temper.scheduler.db.records import MetricRow
from temper.scheduler.db.request_log import NewRequest

Item = TypeVar("Item")


class GroupCommit(Generic[Item]):
    """``add`` waits for its item's write; ``write_group`` (a subclass's) writes a group in a worker
    thread and returns each item's outcome: None, or the exception its caller raises."""

    def __init__(self, store):
        self.store = store
        self._waiting: list[tuple[Item, asyncio.Future]] = []
        self._task: asyncio.Task | None = None  # held: a task nobody references may be collected
        self.groups = 0  # transactions written (items / groups: the batching achieved)

    async def add(self, item: Item) -> None:
        """Returns once ``item`` is committed; raises what its write raised. A cancelled caller's
        item is written all the same."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write())  # after this tick's other items joined
        await future

    def write_group(self, items: list[Item]) -> list[BaseException | None]:
        raise NotImplementedError

    async def _write(self) -> None:
        group: list[tuple[Item, asyncio.Future]] = []
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                self.groups += 1
                try:
                    outcomes = await asyncio.to_thread(self.write_group, [item for item, _ in group])
                except TemperError as exc:  # Unavailable, LeaseLost: the group was not written (or not known to be)
                    outcomes = [_each(exc) for _ in group]
                except Exception as exc:  # noqa: BLE001 - a bug: every caller of the group hears it
                    outcomes = [exc] * len(group)
                for (_, future), outcome in zip(group, outcomes):
                    if future.done():  # its caller was cancelled meanwhile
                        continue
                    if outcome is None:
                        future.set_result(None)
                    else:
                        future.set_exception(outcome)
        except asyncio.CancelledError:  # the scheduler is stopping
            for _, future in group + self._waiting:
                future.cancel()
            raise


class Running(NamedTuple):
    """A mark: these (run, seq) requests are about to go to a trainer (``Store.mark_running``: each
    run's dispatched watermark moves up to its highest seq here)."""
    keys: list[tuple[str, int]]


class RequestWriter(GroupCommit[NewRequest | Running]):
    def write_group(self, items: list[NewRequest | Running]) -> list[BaseException | None]:
        rows = [row for row in items if type(row) is NewRequest]
        running = [key for mark in items if type(mark) is Running for key in mark.keys]
        added = iter(self.store.write_group(rows, running))
        return [next(added) if type(item) is NewRequest else None for item in items]


class Finish(NamedTuple):
    """A cycle's outcomes as ``Store.finish_requests`` records them: (run, seq, status, error, result)
    rows; per run the tokens trained, optimizer steps and next seq; the run_metrics rows; the next
    cycle's requests to mark running."""
    outcomes: list[tuple[str, int, str, str | None, bytes | None]]
    tokens: dict[str, int]
    steps: dict[str, int]
    next_seq: dict[str, int]
    metrics: list[MetricRow]
    running: list[tuple[str, int]]


def merged(finishes: list[Finish]) -> Finish:
    """One Finish of several (different runs': a run's cycles are one at a time, in its lane)."""
    tokens, steps, next_seq = defaultdict(int), defaultdict(int), {}
    for f in finishes:
        for run_id, n in f.tokens.items():
            tokens[run_id] += n
        for run_id, n in f.steps.items():
            steps[run_id] += n
        for run_id, seq in f.next_seq.items():
            next_seq[run_id] = max(next_seq.get(run_id, seq), seq)
    return Finish([o for f in finishes for o in f.outcomes], dict(tokens), dict(steps), next_seq,
                  [m for f in finishes for m in f.metrics], [k for f in finishes for k in f.running])


class FinishWriter(GroupCommit[Finish]):
    def __init__(self, store, result_window: int):
        super().__init__(store)
        self.result_window = result_window

    def write_group(self, items: list[Finish]) -> list[BaseException | None]:
        f = merged(items) if len(items) > 1 else items[0]
        self.store.finish_requests(f.outcomes, f.tokens, f.steps, f.next_seq, self.result_window, f.metrics, f.running)
        return [None] * len(items)


def _each(exc: TemperError) -> TemperError:
    """A copy of ``exc`` per caller (each raises its own); one whose class takes more than a message
    (LeaseLost) is shared."""
    try:
        return type(exc)(exc.message)
    except TypeError:
        return exc
