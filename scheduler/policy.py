"""The batching policy: which pending work goes into the next trainer cycle. A pure function.

A cycle runs every chosen forward/backward first, then the chosen optim steps. For each run the
policy takes work in seq order: passes until the token budget is spent, then at most one
optim_step (the run's turn ends there, so work after a step sees the new weights); a save or load
is a barrier for that run only and runs alone, after the cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from temper.scheduler.work import Work, WorkKind


@dataclass
class CyclePlan:
    passes: list[Work] = field(default_factory=list)
    optim_steps: list[Work] = field(default_factory=list)
    barriers: list[Work] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.passes or self.optim_steps or self.barriers)

    def all_work(self) -> list[Work]:
        return [*self.passes, *self.optim_steps, *self.barriers]


def plan_cycle(ready: dict[str, list[Work]], token_budget: int) -> CyclePlan:
    """``ready`` maps run id → that run's ready work in seq order, runs in priority order."""
    plan = CyclePlan()
    tokens = 0
    for work_list in ready.values():
        for i, work in enumerate(work_list):
            if work.kind.is_pass:
                # The first pass of a cycle always fits, so one oversized request still runs.
                if plan.passes and tokens + work.num_tokens > token_budget:
                    break
                plan.passes.append(work)
                tokens += work.num_tokens
            elif work.kind is WorkKind.OPTIM_STEP:
                plan.optim_steps.append(work)
                break
            else:
                if i == 0:
                    plan.barriers.append(work)
                break
    return plan
