"""Group commit of request rows: the rows of requests admitted while the previous write was under
way (or in the same event-loop tick) go to the database together, in one transaction
(``Store.write_group``), instead of one transaction and commit each. The lanes' "running" marks
(a cycle's work, before it goes to its trainer) join the same transactions. A cycle's outcomes do
not: written by this one writer, they waited behind the admissions' commits and the scheduler sat
idle (benchmarks/README.md, scaleout).

Nothing is acknowledged earlier than before: each caller resumes only once its row is committed,
and hears its own outcome (AlreadyExists for a duplicate (run, seq); a database outage fails the
whole group, each caller with its own Unavailable).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from temper.common.errors import TemperError
from temper.scheduler.db.request_log import NewRequest


class Running(NamedTuple):
    """A mark: these (run, seq) requests are about to go to a trainer (``Store.mark_running``)."""
    keys: list[tuple[str, int]]


class RequestWriter:
    def __init__(self, store):
        self.store = store
        self._waiting: list[tuple[NewRequest | Running, asyncio.Future]] = []
        self._writing = False
        self._task: asyncio.Task | None = None  # held: a task nobody references may be collected
        self.groups = 0  # transactions written (rows / groups: the batching achieved)

    async def add(self, row: NewRequest | Running) -> None:
        """Returns once ``row`` (or the mark) is committed; raises what its write raised."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((row, future))
        if not self._writing:
            self._writing = True
            self._task = asyncio.get_running_loop().create_task(self._write())  # after this tick's other admissions joined
        await future

    async def _write(self) -> None:
        group: list[tuple[NewRequest, asyncio.Future]] = []
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                self.groups += 1
                try:
                    rows = [row for row, _ in group if type(row) is NewRequest]
                    running = [key for mark, _ in group if type(mark) is Running for key in mark.keys]
                    added = iter(await asyncio.to_thread(self.store.write_group, rows, running))
                    outcomes = [next(added) if type(row) is NewRequest else None for row, _ in group]
                except TemperError as exc:  # Unavailable: the group's rows were not written (or not known to be)
                    outcomes = [type(exc)(exc.message) for _ in group]
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
        finally:
            self._writing = False
