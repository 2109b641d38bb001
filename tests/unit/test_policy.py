"""Batching policy and per-run ordering on synthetic queues: no model, no network."""

import pytest

from temper.scheduler.planning.policy import plan_cycle
from temper.scheduler.planning.work import RunQueue, Work, WorkKind, WorkState

FB, FWD, OPT, SAVE, LOAD = WorkKind.FORWARD_BACKWARD, WorkKind.FORWARD, WorkKind.OPTIM_STEP, WorkKind.SAVE_WEIGHTS, WorkKind.LOAD_WEIGHTS


def queue(run, kinds, start=1, tokens=10):
    q = RunQueue(run, start)
    for i, kind in enumerate(kinds):
        q.add(Work(run, start + i, kind, num_tokens=tokens))
    return q


def seqs(works):
    return [(w.run_id, w.seq_id) for w in works]


def test_forward_backward_and_optim_step_share_a_cycle():
    q = queue("a", [FB, OPT, FB, OPT])
    plan = plan_cycle({"a": q.ready()}, token_budget=1000)
    assert seqs(plan.passes) == [("a", 1)]
    assert seqs(plan.optim_steps) == [("a", 2)]
    assert plan.barriers == []


def test_work_after_an_optim_step_waits_for_the_next_cycle():
    q = queue("a", [FB, FB, OPT, FB])
    plan = plan_cycle({"a": q.ready()}, 1000)
    assert seqs(plan.passes) == [("a", 1), ("a", 2)] and seqs(plan.optim_steps) == [("a", 3)]
    for w in plan.all_work():
        q.take(w)
    plan = plan_cycle({"a": q.ready()}, 1000)
    assert seqs(plan.passes) == [("a", 4)] and plan.optim_steps == []


def test_a_cycle_holds_at_most_as_many_items_of_a_run_as_a_trainer_keeps_answers_for():
    from temper.common.cycles import ITEMS_PER_RUN_PER_CYCLE as most

    q = queue("a", [FB] * 40 + [OPT])
    plan = plan_cycle({"a": q.ready(), "b": queue("b", [FB, OPT]).ready()}, 10_000)
    assert seqs(plan.passes) == [("a", s) for s in range(1, most)] + [("b", 1)] and seqs(plan.optim_steps) == [("b", 2)]
    short = queue("c", [FB] * (most - 1) + [OPT])
    plan = plan_cycle({"c": short.ready()}, 10_000)
    assert len(plan.passes) + len(plan.optim_steps) == most  # a full run's passes and its step still fit together


def test_ordering_waits_for_gaps():
    q = RunQueue("a", 1)
    q.add(Work("a", 2, FB))
    q.add(Work("a", 3, OPT))
    assert q.ready() == []  # seq 1 has not arrived: nothing may run
    q.add(Work("a", 1, FB))
    assert [w.seq_id for w in q.ready()] == [1, 2, 3]


def test_a_gap_is_dated_by_the_oldest_work_behind_it_and_skipping_it_releases_that_work():
    q = RunQueue("a", 1)
    assert q.gap_since() is None  # nothing waiting
    q.add(Work("a", 4, FB, submitted_at=20.0))
    q.add(Work("a", 3, FB, submitted_at=30.0))
    q.add(Work("a", 6, OPT, submitted_at=10.0))
    assert q.gap_since() == 10.0
    assert q.skip_gap() == range(1, 3)  # seqs 1 and 2 are given up on, not 5
    assert [w.seq_id for w in q.ready()] == [3, 4]
    assert q.was_skipped(1) and q.was_skipped(2) and not q.was_skipped(3) and not q.was_skipped(5)
    for w in q.ready():
        q.take(w)
    assert q.gap_since() == 10.0  # seq 5 is missing now, with seq 6 behind it
    q.add(Work("a", 5, FB, submitted_at=40.0))
    assert q.gap_since() is None


def test_rejected_work_holds_its_place_then_is_skipped():
    q = RunQueue("a", 1)
    q.add(Work("a", 1, FB, state=WorkState.REJECTED))
    q.add(Work("a", 2, OPT))
    assert [w.seq_id for w in q.ready()] == [2]
    assert q.next_seq_id == 2


def test_barrier_is_per_run_and_runs_alone():
    a = queue("a", [SAVE, FB])
    b = queue("b", [FB, OPT])
    c = queue("c", [FB, LOAD, FB])
    plan = plan_cycle({"a": a.ready(), "b": b.ready(), "c": c.ready()}, 1000)
    assert seqs(plan.barriers) == [("a", 1)]
    assert seqs(plan.passes) == [("b", 1), ("c", 1)]  # c's load waits until its earlier pass ran
    assert seqs(plan.optim_steps) == [("b", 2)]


def test_token_budget_bounds_a_cycle_but_one_oversized_pass_still_runs():
    a = queue("a", [FB, FB, FB], tokens=400)
    b = queue("b", [FB], tokens=100)
    plan = plan_cycle({"a": a.ready(), "b": b.ready()}, token_budget=1000)
    assert seqs(plan.passes) == [("a", 1), ("a", 2), ("b", 1)]
    huge = queue("h", [FB, FB], tokens=5000)
    plan = plan_cycle({"h": huge.ready()}, token_budget=1000)
    assert seqs(plan.passes) == [("h", 1)]


def test_forward_only_counts_as_a_pass_and_empty_queues_plan_nothing():
    q = queue("a", [FWD, FB])
    plan = plan_cycle({"a": q.ready()}, 1000)
    assert seqs(plan.passes) == [("a", 1), ("a", 2)]
    assert not plan_cycle({}, 1000)


# ---- fair share across tenants ------------------------------------------------------------------

from collections import Counter  # noqa: E402

from temper.scheduler.planning.policy import FairShare  # noqa: E402


def simulate(runs: dict[str, tuple[str, int, int]], cycles: int, budget: int, share: FairShare):
    """runs: run id -> (tenant, tokens per request, requests). Returns tokens served per tenant per cycle."""
    queues = {run: queue(run, [FB] * n, tokens=t) for run, (_, t, n) in runs.items()}
    tenant_of = {run: tenant for run, (tenant, _, _) in runs.items()}
    served = []
    for _ in range(cycles):
        plan = plan_cycle({r: q.ready() for r, q in queues.items()}, budget, tenant_of, share)
        got = Counter()
        for w in plan.all_work():
            queues[w.run_id].take(w)
            got[tenant_of[w.run_id]] += w.num_tokens
        served.append(got)
    return served


def test_a_tenant_with_huge_batches_cannot_starve_one_with_small_ones():
    share = FairShare(quantum=256)
    served = simulate({"big": ("alice", 4000, 500), "small": ("bob", 100, 5000)}, cycles=20, budget=4096, share=share)
    # bob never waits more than one cycle, and the tokens split evenly (within two big requests:
    # alice first has to bank a deficit as large as her request)
    assert all(a["bob"] > 0 or b["bob"] > 0 for a, b in zip(served, served[1:]))
    total = sum(served, Counter())
    assert abs(total["alice"] - total["bob"]) <= 2 * 4000


def test_token_shares_follow_the_weights():
    share = FairShare(quantum=100, weights={"alice": 2.0, "bob": 1.0})
    served = simulate({"a1": ("alice", 100, 500), "a2": ("alice", 100, 500), "b1": ("bob", 100, 1000)},
                      cycles=30, budget=900, share=share)
    total = sum(served, Counter())
    assert total["alice"] / total["bob"] == pytest.approx(2.0, rel=0.1)


def test_idle_tenants_do_not_bank_credit_and_equal_tenants_split_evenly():
    share = FairShare(quantum=100)
    served = simulate({"a": ("alice", 100, 1000), "b": ("bob", 100, 1000), "c": ("carol", 100, 1000)},
                      cycles=10, budget=600, share=share)
    total = sum(served, Counter())
    assert total["alice"] == total["bob"] == total["carol"] == 2000
    simulate({"x": ("dave", 100, 1)}, cycles=3, budget=600, share=share)
    assert share.deficits["dave"] == 0.0


def test_fair_share_keeps_each_runs_order_and_barriers():
    share = FairShare(quantum=50)
    a = queue("a", [FB, FB, OPT, FB], tokens=100)
    b = queue("b", [SAVE, FB], tokens=100)
    plan = plan_cycle({"a": a.ready(), "b": b.ready()}, 1000, {"a": "alice", "b": "bob"}, share)
    assert seqs(plan.passes) == [("a", 1), ("a", 2)]
    assert seqs(plan.optim_steps) == [("a", 3)]
    assert seqs(plan.barriers) == [("b", 1)]
