"""The batching policy: which pending work goes into the next trainer cycle. A pure function.

A cycle runs every chosen forward/backward first, then the chosen optim steps. Per run, work is
taken in seq order: passes, then at most one optim_step (the run's turn ends there, so work after
a step sees the new weights); a save or load is a barrier for that run only and runs alone,
after the cycle.

Across tenants, pass tokens are shared by weighted deficit round robin: each round a tenant's
deficit grows by ``quantum × weight`` and it takes passes while their tokens fit in its deficit
and the cycle's budget. A tenant submitting huge batches therefore cannot starve one submitting
small ones, and over many cycles tenants get tokens in proportion to their weights.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from temper.common.cycles import ITEMS_PER_RUN_PER_CYCLE
from temper.scheduler.planning.work import Work, WorkKind


@dataclass
class CyclePlan:
    passes: list[Work] = field(default_factory=list)
    optim_steps: list[Work] = field(default_factory=list)
    barriers: list[Work] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.passes or self.optim_steps or self.barriers)

    def all_work(self) -> list[Work]:
        return [*self.passes, *self.optim_steps, *self.barriers]


@dataclass
class FairShare:
    """Deficit-round-robin state carried from one cycle to the next."""

    weights: dict[str, float] = field(default_factory=dict)   # tenant -> weight (default 1.0)
    quantum: int = 1024                                        # tokens per round at weight 1.0
    deficits: dict[str, float] = field(default_factory=dict)
    rotation: int = 0                                          # which tenant starts the next cycle


class _RunCursor:
    """Walks one run's ready work; passes are taken one at a time, at most ITEMS_PER_RUN_PER_CYCLE
    items of the run per cycle (with its optim step): the trainer holds that many answers of a run
    for a resent cycle."""

    def __init__(self, works: list[Work]):
        self.works = deque(works)
        self.taken = 0

    def next_pass(self) -> Work | None:
        if self.taken >= ITEMS_PER_RUN_PER_CYCLE - 1:  # room left for the optim step after them
            return None
        return self.works[0] if self.works and self.works[0].kind.is_pass else None

    def take_pass(self) -> Work:
        self.taken += 1
        return self.works.popleft()


def plan_cycle(ready: dict[str, list[Work]], token_budget: int, tenant_of: dict[str, str] | None = None,
               share: FairShare | None = None) -> CyclePlan:
    """``ready``: run id → that run's ready work in seq order. ``tenant_of``: run id → tenant
    (default: every run its own tenant). ``share`` is updated in place."""
    plan = CyclePlan()
    share = share if share is not None else FairShare()
    tenant_of = tenant_of or {}
    cursors: dict[str, dict[str, _RunCursor]] = {}
    for run_id, works in ready.items():
        if not works:
            continue
        if works[0].kind.is_barrier:
            plan.barriers.append(works[0])
            continue
        cursors.setdefault(tenant_of.get(run_id, run_id), {})[run_id] = _RunCursor(works)
    tenants = sorted(cursors)
    if tenants:
        start = share.rotation % len(tenants)
        tenants = tenants[start:] + tenants[:start]
    share.rotation += 1

    remaining = token_budget
    while True:
        candidates = [t for t in tenants if any(c.next_pass() for c in cursors[t].values())]
        # Stop when nothing fits (a pass larger than the budget only runs in an otherwise empty cycle).
        if not any(_fits(c.next_pass(), remaining, plan) for t in candidates for c in cursors[t].values()):
            break
        for tenant in candidates:
            share.deficits[tenant] = share.deficits.get(tenant, 0.0) + max(share.quantum, 1) * max(share.weights.get(tenant, 1.0), 0.01)
            runs = list(cursors[tenant].values())
            progress = True
            while progress:  # round robin over the tenant's runs
                progress = False
                for cursor in runs:
                    work = cursor.next_pass()
                    if work is None or work.num_tokens > share.deficits[tenant] or not _fits(work, remaining, plan):
                        continue
                    plan.passes.append(cursor.take_pass())
                    share.deficits[tenant] -= work.num_tokens
                    remaining -= work.num_tokens
                    progress = True

    for tenant, runs in cursors.items():
        for cursor in runs.values():
            if cursor.works and cursor.works[0].kind is WorkKind.OPTIM_STEP:
                plan.optim_steps.append(cursor.works[0])
        if not any(c.next_pass() for c in runs.values()):
            share.deficits[tenant] = 0.0  # an idle tenant does not bank credit (classic DRR)
    return plan


def _fits(work: Work | None, remaining: int, plan: CyclePlan) -> bool:
    return work is not None and (work.num_tokens <= remaining or not plan.passes)
