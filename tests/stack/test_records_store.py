"""The records kept after an answer (scheduler/db/records.py) on a real Postgres (and SQLite): run metric rows
written with their requests' outcomes (steps counted there, a resent finish records nothing twice),
step ranges and pages, sampling records with their counters, time buckets counted by the database,
and the retention prune (by age, by rows per run), which leaves everything else alone."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from temper.common.errors import NotFound
from temper.scheduler.db.records import MetricRow, SamplingRow
from temper.scheduler.db.request_log import NewRequest
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.planning.records import prune_once, unix_ms
from temper.scheduler.planning.runs import new_run_row
from temper.v1 import types_pb2

LORA = types_pb2.LoraConfig(rank=4, alpha=8.0, train_attn=True, train_mlp=True, train_unembed=False)


@pytest.fixture(params=["postgres", "sqlite"])
def store(request, new_postgres_database, tmp_path):
    """On Postgres (deployment) and SQLite (make demo / make serve) alike."""
    url = new_postgres_database() if request.param == "postgres" else f"sqlite:///{tmp_path / 'records.db'}"
    upgrade_schema(url)
    s = Store(url)
    s.url = url
    yield s
    s.engine.dispose()


def make_run(store, tenant: str = "alice") -> tuple[str, str]:
    session = store.create_session(tenant, [], {})
    run_id = f"{session.id}:train:0"
    store.add_training_run(new_run_row(run_id, session.id, "m", LORA, {}, "t:1", None))
    return session.id, run_id


def metric(run_id: str, seq: int, kind: str, status: str = "done", loss: float | None = None, answered: int = 10_000,
           **fields) -> MetricRow:
    values = dict(error=None if status == "done" else "INVALID_ARGUMENT: no", loss=loss, num_tokens=5 if "forward" in kind else 0,
                  grad_norm=None, learning_rate=None, metrics={"loss:sum": loss} if loss is not None else {}, cobatched_with=1,
                  trainer="t:1", cycle=seq, created_ms=answered - 30, started_ms=answered - 20, answered_ms=answered)
    values.update(fields)
    return MetricRow(run_id, seq, kind, status, **values)


def finish(store, run_id: str, rows: list[MetricRow]) -> None:
    """Requests queued then finished with these metric rows, as the loop does (one transaction)."""
    store.add_requests([NewRequest(run_id, r.seq_id, r.kind, "", "queued", r.num_tokens) for r in rows
                        if store.get_request(run_id, r.seq_id) is None])
    outcomes = [(run_id, r.seq_id, r.status, r.error, b"") for r in rows]
    steps = sum(1 for r in rows if r.kind == "optim_step" and r.status == "done")
    store.finish_requests(outcomes, {run_id: 0}, {run_id: steps}, {run_id: max(r.seq_id for r in rows) + 1}, 256, rows)


def test_metric_rows_are_written_with_outcomes_and_count_steps_once(store):
    _, run_id = make_run(store)
    first = [metric(run_id, 1, "forward_backward", loss=2.5), metric(run_id, 2, "optim_step", grad_norm=0.75, learning_rate=1e-3,
                                                                     metrics={"grad_norm:mean": 0.75, "learning_rate:mean": 1e-3})]
    finish(store, run_id, first)
    finish(store, run_id, first)  # resent after a commit whose answer was lost: nothing twice
    finish(store, run_id, [metric(run_id, 3, "forward", loss=2.25), metric(run_id, 4, "forward_backward", status="failed"),
                           metric(run_id, 5, "forward_backward", loss=2.0), metric(run_id, 6, "optim_step")])
    rows = store.run_metrics(run_id, 0, None, 0, 100)
    assert [(r.seq_id, r.kind, r.status, r.step) for r in rows] == [
        (1, "forward_backward", "done", 0), (2, "optim_step", "done", 1), (3, "forward", "done", 1),
        (4, "forward_backward", "failed", 1), (5, "forward_backward", "done", 1), (6, "optim_step", "done", 2)]
    assert rows[0].loss == 2.5 and rows[0].metrics == {"loss:sum": 2.5} and rows[0].num_tokens == 5
    assert rows[1].grad_norm == 0.75 and rows[1].learning_rate == 1e-3 and rows[1].loss is None
    assert rows[3].error == "INVALID_ARGUMENT: no" and rows[3].loss is None
    assert rows[0].queued_seconds == pytest.approx(0.01) and rows[0].trainer_seconds == pytest.approx(0.02)
    assert store.get_training_run(run_id).steps == 2  # the counters moved once too


def test_step_ranges_and_pages(store):
    _, run_id = make_run(store)
    rows = []
    for step in range(10):  # forward_backward at odd seqs, optim_step at even: seq 2k+1 has step k
        rows += [metric(run_id, 2 * step + 1, "forward_backward", loss=1.0 / (step + 1)), metric(run_id, 2 * step + 2, "optim_step")]
    finish(store, run_id, rows)
    assert [r.seq_id for r in store.run_metrics(run_id, 3, 4, 0, 100)] == [6, 7, 8, 9]  # steps 3..4: optim 3 (seq 6) ... fb at step 4
    assert [r.step for r in store.run_metrics(run_id, 3, 4, 0, 100)] == [3, 3, 4, 4]
    assert [r.seq_id for r in store.run_metrics(run_id, 9, None, 0, 100)] == [18, 19, 20]
    assert [r.seq_id for r in store.run_metrics(run_id, 0, None, 5, 3)] == [6, 7, 8]
    assert store.run_metrics(run_id, 11, None, 0, 100) == []


def test_sampling_records_counters_and_buckets(store):
    session_id, _ = make_run(store)
    sampler = store.add_sampling_client(session_id, "m", None)
    base = 1_000_000
    store.record_sampling([SamplingRow(session_id, sampler.id, "sample", 2, 10, 8, base + 100, base + 400),
                           SamplingRow(session_id, sampler.id, "sample", 1, 5, 3, base + 900, base + 1000),
                           SamplingRow(session_id, sampler.id, "compute_logprobs", 0, 7, 0, base + 2500, base + 2600)])
    assert store.get_sampling_client(sampler.id)[0].tokens_sampled == 11
    records = store.sampling_records(session_id, base, base + 10_000, None, 2)
    assert [(r.kind, r.prompt_tokens, r.tokens_sampled) for r in records] == [("sample", 10, 8), ("sample", 5, 3)]
    rest = store.sampling_records(session_id, base, base + 10_000, (records[-1].started_ms, records[-1].id), 10)
    assert [r.kind for r in rest] == ["compute_logprobs"]
    buckets = store.sampling_buckets(session_id, base, base + 10_000, 1000)
    assert [tuple(b) for b in buckets] == [(0, 2, 15, 11, 400), (2, 1, 7, 0, 100)]
    detail = store.session_detail(session_id, "alice")
    assert (detail.requests, detail.prompt_tokens, detail.tokens_sampled, detail.sampler_ids) == (3, 22, 11, [sampler.id])
    with pytest.raises(NotFound, match="not found"):
        store.session_detail(session_id, "bob")


def test_prune_by_age_and_by_rows_per_run(store):
    session_id, run_id = make_run(store)
    _, other_run = make_run(store, "bob")
    now = unix_ms()
    old, recent = now - 3_600_000, now - 1000
    finish(store, run_id, [metric(run_id, seq, "forward_backward", loss=1.0, answered=old if seq <= 3 else recent)
                           for seq in range(1, 11)])
    finish(store, other_run, [metric(other_run, seq, "forward_backward", loss=1.0, answered=recent) for seq in range(1, 6)])
    sampler = store.add_sampling_client(session_id, "m", None)
    store.record_sampling([SamplingRow(session_id, sampler.id, "sample", 1, 3, 2, old, old + 5),
                           SamplingRow(session_id, sampler.id, "sample", 1, 3, 2, recent, recent + 5)])
    import asyncio

    # older than 60 s goes (seqs 1-3 of run, one sampling record); then at most 4 rows per run
    assert asyncio.run(prune_once(store, 60, 0)) == (3, 1)
    assert [r.seq_id for r in store.run_metrics(run_id, 0, None, 0, 100)] == list(range(4, 11))
    assert asyncio.run(prune_once(store, 60, 4)) == (3 + 1, 0)
    assert [r.seq_id for r in store.run_metrics(run_id, 0, None, 0, 100)] == [7, 8, 9, 10]
    assert [r.seq_id for r in store.run_metrics(other_run, 0, None, 0, 100)] == [2, 3, 4, 5]
    assert asyncio.run(prune_once(store, 60, 4)) == (0, 0)  # nothing more to prune
    assert [r.started_ms for r in store.sampling_records(session_id, 0, now + 1, None, 10)] == [recent]
    engine = create_engine(store.url)
    with engine.connect() as conn:  # the requests and their counters are the prune's to leave alone
        assert conn.execute(text("select count(*) from requests")).scalar() == 15
        assert conn.execute(text("select tokens_sampled from sampling_clients")).scalar() == 4
    engine.dispose()
