"""A lane: one trainer's dispatcher. It plans cycles from the ready work of the runs placed on its
trainer only, runs each there, and loops:

    while True:
        wait until work arrives (or a run's missing seq was waited for too long: skip it)
        while (plan := plan_cycle(ready work of this trainer's runs, budget, this lane's fair share)):
            restore the plan's runs whose adapter was lost, if any (recovery.py), and plan again
            take the planned work off its queues
            run the cycle on the trainer, record it, answer the callers (SchedulerLoop.run_cycle)

The scheduler runs one lane per trainer, all at once (``loop.py``): a second trainer adds
throughput, and a slow or silent trainer holds only the runs placed on it. A run is placed on one
trainer for good (``Backends.trainer_for``), so its work stays in seq order in one lane; saves and
loads are barriers of their run within its lane. Fair share is kept per lane: each trainer's
cycles share its tokens across the tenants with work there.
"""

from __future__ import annotations

import logging
from typing import Protocol

from temper.common.errors import TemperError, Unavailable
from temper.scheduler.cluster.ownership import LaneOwner
from temper.scheduler.planning.admission import Admission
from temper.scheduler.planning.policy import CyclePlan, FairShare, plan_cycle
from temper.scheduler.planning.recovery import Recovery
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.workers.backends import TrainerHandle
from temper.scheduler.planning.work import Work

log = logging.getLogger(__name__)


class LaneHost(Protocol):
    """What a lane needs of the loop that runs it (SchedulerLoop): the loop builds on lanes, not the
    other way round."""
    admission: Admission
    settings: SchedulerSettings
    recovery: Recovery
    in_flight: dict[str, TrainerHandle]
    ownership: LaneOwner

    async def run_cycle(self, trainer: TrainerHandle, plan: CyclePlan) -> None: ...
    def trainer_of_run(self, run_id: str) -> TrainerHandle | None: ...


class Lane:
    def __init__(self, loop: LaneHost, trainer: TrainerHandle, share: FairShare):
        self.loop = loop
        self.trainer = trainer
        self.share = share
        self.woken = loop.admission.wake.waiter()

    async def run_forever(self) -> None:
        admission, budget = self.loop.admission, self.loop.settings.cycle_token_budget
        while True:
            await admission.wait_for_work(self.woken)
            while plan := plan_cycle(ready := self.ready(), budget, {run: works[0].tenant for run, works in ready.items()}, self.share):
                if await self.loop.recovery.restore_before(self.trainer, plan):
                    continue  # a run of the plan lost its adapter: rebuilt (or moved, or refused) first; plan again
                admission.take(plan.all_work())
                await self.loop.run_cycle(self.trainer, plan)
                admission.skip_expired_gaps()

    def ready(self) -> dict[str, list[Work]]:
        """Admission's ready work (oldest head first) of the runs placed on this lane's trainer; another
        lane's runs are passed over before their queues are looked at."""
        refused: dict[str, TemperError] = {}
        held = self.loop.ownership.holds(self.trainer.address)  # replicas: another may own this lane now

        def placed_here(run_id: str) -> bool:
            try:
                return self.loop.trainer_of_run(run_id) is self.trainer
            except TemperError as exc:  # placed on a trainer this scheduler does not reach, or none serves its model
                refused[run_id] = exc
                return True

        mine = {}
        for run_id, works in self.loop.admission.ready(placed_here).items():
            if run_id in refused:
                self._turn_away(works, refused[run_id])
            elif not held:
                self._turn_away(works, Unavailable(f"this scheduler replica does not hold the lane of trainer "
                                                   f"{self.trainer.address} now"))
            # a run moved here while its work is still on its old trainer waits for that work's outcome
            elif self.loop.in_flight.get(run_id, self.trainer) is self.trainer:
                mine[run_id] = works
        return mine

    def _turn_away(self, works: list[Work], exc: TemperError) -> None:
        """Work no lane can run: answered UNAVAILABLE now (nothing ran; the client resends it)."""
        log.warning("run %s: %s; answered UNAVAILABLE", works[0].run_id, exc.message)
        self.loop.admission.take(works)
        self.loop.admission.release(works, Unavailable(f"{exc.message}; nothing was applied: resend it"))
