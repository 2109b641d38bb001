"""A lane changing hands between scheduler replicas, as the planning layer sees it: the hooks that
``cluster.ownership.LaneOwnership`` calls (which runs are on a lane, whether it is idle, what to
forget when it is taken or given up, and health).

What a replica knows of a run in memory (its queue and next seq, remembered answers, recovery
counters, its RunInfo) is only true while the replica owns the run's lane: another replica may have
run the lane since. So taking a lane, or giving it up, forgets its runs here; their next use loads
them from the database, exactly as a scheduler process does after a restart. Work of those runs
still unanswered here is answered UNAVAILABLE, and the client's resend reaches the lane's owner.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

from temper.common.errors import Unavailable
from temper.scheduler.planning.admission import Admission
from temper.scheduler.planning.recovery import Recovery
from temper.scheduler.planning.runs import RunRegistry
from temper.scheduler.workers.backends import Backends, TrainerHandle

log = logging.getLogger(__name__)


class HandoverHost(Protocol):
    admission: Admission
    backends: Backends
    runs: RunRegistry
    recovery: Recovery
    in_flight: dict[str, TrainerHandle]


class LaneHandover:
    def __init__(self, loop: HandoverHost, on_health: Callable[[bool], None] = lambda serving: None):
        self.loop = loop
        self.on_health = on_health
        self._claims: set[asyncio.Task] = set()  # held: an unreferenced task may be collected mid-way

    def lanes(self) -> list[str]:
        return [t.address for t in self.loop.backends.trainers]

    def lane_of(self, run_id: str) -> str | None:
        return self.loop.backends.placements.get(run_id)

    def runs_on(self, lane: str) -> list[str]:
        return sorted(run_id for run_id, address in self.loop.backends.placements.items() if address == lane)

    def idle(self, lane: str) -> bool:
        """No work of the lane's runs is held here, and none is on a trainer."""
        admission = self.loop.admission
        return not any(holds_work_of(admission, run_id) or run_id in self.loop.in_flight for run_id in self.runs_on(lane))

    def gained(self, lane: str) -> None:
        self._forget(lane, "taken")
        self.loop.admission.wake.set()
        trainer = self.loop.backends.trainer_at(lane)
        if trainer is not None:  # the trainer learns the new token now: a former owner's calls are refused there
            task = asyncio.get_running_loop().create_task(trainer.claim(), name=f"claim {lane}")
            self._claims.add(task)
            task.add_done_callback(self._claims.discard)

    def releasing(self, lane: str) -> None:
        self._forget(lane, "given up")

    def health(self, serving: bool) -> None:
        self.on_health(serving)

    def _forget(self, lane: str, how: str) -> None:
        runs = self.runs_on(lane)
        why = Unavailable(f"the lane of trainer {lane} changed hands between scheduler replicas; resend")
        for run_id in runs:
            forget_run_work(self.loop.admission, run_id, why)
            self.loop.recovery.forget(run_id)
            self.loop.runs.forget(run_id)
            self.loop.backends.placements.pop(run_id, None)  # read again with the run (it may have moved meanwhile)
        log.info("lane %s %s: forgot %d runs held in memory", lane, how, len(runs))


def forget_run_work(admission: Admission, run_id: str, why: Unavailable) -> None:
    """Drop the run's queue and remembered work from ``admission``. Work still unanswered here is
    answered ``why``: the client resends it to the lane's owner, which answers from the (run, seq) log."""
    queue = admission.queues.pop(run_id, None)
    keys = [key for key in admission.recent if key[0] == run_id]
    works = [admission.recent.pop(key) for key in keys] + (list(queue.pending.values()) if queue else [])
    for work in works:
        work.fail(why)


def holds_work_of(admission: Admission, run_id: str) -> bool:
    """Whether any work of the run is held in ``admission`` unanswered (claimed, queued, or in a cycle)."""
    queue = admission.queues.get(run_id)
    if queue is not None and queue.pending:
        return True
    return any(key[0] == run_id and w.future is not None and not w.future.done() for key, w in admission.recent.items())
