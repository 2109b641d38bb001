"""What the scheduler keeps after an answer (issue 22): each run's per-request metrics
(``run_metrics``), each session's sampling records (``sampling_records``), and the reads of the
public API over them and over sessions (ListRunMetrics, ListSessions, GetSession,
GetSessionSamplingMetrics). A mixin of ``Store``.

Writes ride on writes the scheduler makes anyway: a cycle's metric rows go into the transaction that
records its outcomes (``request_log._finish_requests`` calls ``insert_run_metrics``), so a resent
finish records them once, with the outcomes; sampling records are group-committed with the sampling
clients' token counters (``record_sampling``). Retention: ``prune_records`` (the scheduler's
periodic prune, ``planning/records.py``). Times are unix milliseconds.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from temper.common.errors import NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db import pg_batch
from temper.scheduler.db.outage import database_errors

METRICS = m.RunMetric.__table__
SAMPLING = m.SamplingRecord.__table__
RUNS = m.TrainingRun.__table__
_INSERT_METRICS = insert(METRICS)
# A request recorded again (its answer re-sent after a crash left its row open, or an operator reset
# it) keeps its first metrics row: the answer is the same, and a duplicate must not stop the loop.
_INSERT_METRICS_ONCE = {
    "postgresql": postgresql_insert(METRICS).on_conflict_do_nothing(index_elements=["training_run_id", "seq_id"]),
    "sqlite": sqlite_insert(METRICS).on_conflict_do_nothing(index_elements=["training_run_id", "seq_id"]),
}
_INSERT_SAMPLING = insert(SAMPLING)
_RUN_STEPS = select(RUNS.c.id, RUNS.c.steps).where(RUNS.c.id.in_(bindparam("b_runs", expanding=True)))
_ADD_SAMPLED = update(m.SamplingClient.__table__).where(m.SamplingClient.__table__.c.id == bindparam("b_id")).values(
    tokens_sampled=m.SamplingClient.__table__.c.tokens_sampled + bindparam("b_tokens"))


class MetricRow(NamedTuple):
    """A run's answered request, as the loop saw it (``planning/records.py`` builds it); its step is
    counted in the transaction that writes it."""
    run_id: str
    seq_id: int
    kind: str
    status: str
    error: str | None
    loss: float | None
    num_tokens: int
    grad_norm: float | None
    learning_rate: float | None
    metrics: dict
    cobatched_with: int
    trainer: str
    cycle: int
    created_ms: int
    started_ms: int
    answered_ms: int


class SamplingRow(NamedTuple):
    session_id: str
    sampler_id: str
    kind: str  # sample | compute_logprobs
    num_samples: int
    prompt_tokens: int
    tokens_sampled: int
    started_ms: int
    answered_ms: int


class SessionDetail(NamedTuple):
    row: m.Session
    run_ids: list[str]
    sampler_ids: list[str]
    requests: int
    prompt_tokens: int
    tokens_sampled: int


class Bucket(NamedTuple):
    index: int  # (started_ms - from) // bucket_ms
    requests: int
    prompt_tokens: int
    tokens_sampled: int
    busy_ms: int


def insert_run_metrics(conn, rows: list[MetricRow], still_open: set[tuple[str, int]]) -> None:
    """The rows of requests being recorded now (``still_open``: a resent finish finds none), each with
    its run's optimizer step (``metric_values``). Called before the run counters move
    (request_log._finish_requests)."""
    runs = sorted({r.run_id for r in rows if (r.run_id, r.seq_id) in still_open})
    if not runs:
        return
    steps = {run_id: counted for run_id, counted in conn.execute(_RUN_STEPS, {"b_runs": runs})}
    values = metric_values(rows, still_open, steps)
    if pg_batch.is_psycopg2(conn):
        pg_batch.insert_metrics(conn, values)  # one multi-row statement
    else:
        conn.execute(_INSERT_METRICS_ONCE.get(conn.dialect.name, _INSERT_METRICS), values)


def metric_values(rows: list[MetricRow], still_open: set[tuple[str, int]], steps: dict[str, int]) -> list[dict]:
    """run_metrics values of the rows being recorded now, each with its run's optimizer step: the
    run's counted ``steps`` before this transaction's, plus its optim steps done up to it."""
    steps, values = dict(steps), []
    for r in sorted((r for r in rows if (r.run_id, r.seq_id) in still_open), key=lambda r: (r.run_id, r.seq_id)):
        if r.kind == "optim_step" and r.status == "done":
            steps[r.run_id] = steps.get(r.run_id, 0) + 1
        values.append(dict(training_run_id=r.run_id, seq_id=r.seq_id, step=steps.get(r.run_id, 0), kind=r.kind, status=r.status,
                           error=r.error, loss=r.loss, num_tokens=r.num_tokens, grad_norm=r.grad_norm, learning_rate=r.learning_rate,
                           metrics=r.metrics, queued_seconds=max(0, r.started_ms - r.created_ms) / 1000,
                           trainer_seconds=max(0, r.answered_ms - r.started_ms) / 1000, cobatched_with=r.cobatched_with,
                           trainer=r.trainer, cycle=r.cycle, created_ms=r.created_ms, started_ms=r.started_ms,
                           answered_ms=r.answered_ms))
    return values


@database_errors
class RecordsStore:
    sessions = None  # sessionmaker, set by Store
    engine = None

    # ---- writes ---------------------------------------------------------------------------------

    def record_sampling(self, rows: list[SamplingRow]) -> None:
        """Sampling records and their clients' token counters, in one transaction (a group of answers)."""
        if not rows:
            return
        tokens: dict[str, int] = {}
        for r in rows:
            tokens[r.sampler_id] = tokens.get(r.sampler_id, 0) + r.tokens_sampled
        with self.engine.begin() as conn:
            conn.execute(_INSERT_SAMPLING, [r._asdict() for r in rows])
            counted = [dict(b_id=sid, b_tokens=n) for sid, n in sorted(tokens.items()) if n]
            if counted:
                conn.execute(_ADD_SAMPLED, counted)

    def prune_records(self, before_ms: int, max_rows_per_run: int) -> tuple[int, int]:
        """Deletes run metrics answered and sampling records started before ``before_ms`` (0: none by
        age), and each run's metric rows more than ``max_rows_per_run`` seqs below its newest (0: no
        cap). Returns (run metric rows, sampling records) deleted."""
        metrics = sampled = 0
        with self.engine.begin() as conn:
            if before_ms > 0:
                metrics += conn.execute(delete(METRICS).where(METRICS.c.answered_ms < before_ms)).rowcount
                sampled += conn.execute(delete(SAMPLING).where(SAMPLING.c.started_ms < before_ms)).rowcount
            if max_rows_per_run > 0:
                over = conn.execute(select(METRICS.c.training_run_id, func.max(METRICS.c.seq_id)).group_by(METRICS.c.training_run_id)
                                    .having(func.count() > max_rows_per_run)).all()
                for run_id, newest in over:
                    # the run's newest max_rows_per_run rows stay: cut below the seq of the oldest of them
                    keep_from = conn.execute(select(METRICS.c.seq_id).where(METRICS.c.training_run_id == run_id)
                                             .order_by(METRICS.c.seq_id.desc()).offset(max_rows_per_run - 1).limit(1)).scalar()
                    metrics += conn.execute(delete(METRICS).where(METRICS.c.training_run_id == run_id,
                                                                  METRICS.c.seq_id < keep_from)).rowcount
        return metrics, sampled

    # ---- reads ----------------------------------------------------------------------------------

    def run_metrics(self, run_id: str, from_step: int, to_step: int | None, after_seq: int, limit: int) -> list[m.RunMetric]:
        """The run's metric rows with from_step <= step (<= to_step) and seq > after_seq, in seq order."""
        query = select(m.RunMetric).where(m.RunMetric.training_run_id == run_id, m.RunMetric.step >= from_step,
                                          m.RunMetric.seq_id > after_seq)
        if to_step is not None:
            query = query.where(m.RunMetric.step <= to_step)
        with self.sessions() as db:
            return list(db.scalars(query.order_by(m.RunMetric.seq_id).limit(limit)))

    def tenant_sessions(self, tenant: str, limit: int, offset: int, project_id: str = "") -> tuple[list[m.Session], int]:
        """The tenant's sessions (with ``project_id``: that project's), newest first, and how many."""
        with self.sessions() as db:
            tenant_id = db.scalar(select(m.Tenant.id).where(m.Tenant.name == tenant))
            if tenant_id is None:
                return [], 0
            mine = m.Session.tenant_id == tenant_id
            if project_id:
                mine = mine & (m.Session.project_id == project_id)
            rows = db.scalars(select(m.Session).where(mine).order_by(m.Session.created_at.desc(), m.Session.id.desc())
                              .limit(limit).offset(offset)).all()
            return list(rows), db.scalar(select(func.count()).select_from(m.Session).where(mine))

    def session_detail(self, session_id: str, tenant: str) -> SessionDetail:
        """The tenant's session with its runs, sampling clients and sampling counts; NotFound for
        another tenant's (the same answer as a missing one)."""
        with self.sessions() as db:
            found = db.execute(select(m.Session, m.Tenant.name).join(m.Tenant, m.Tenant.id == m.Session.tenant_id)
                               .where(m.Session.id == session_id)).first()
            if found is None or found[1] != tenant:
                raise NotFound(f"session {session_id!r} not found")
            runs = db.scalars(select(m.TrainingRun.id).where(m.TrainingRun.session_id == session_id)
                              .order_by(m.TrainingRun.created_at, m.TrainingRun.id)).all()
            samplers = db.scalars(select(m.SamplingClient.id).where(m.SamplingClient.session_id == session_id)
                                  .order_by(m.SamplingClient.created_at, m.SamplingClient.id)).all()
            counts = db.execute(select(func.count(), func.coalesce(func.sum(SAMPLING.c.prompt_tokens), 0),
                                       func.coalesce(func.sum(SAMPLING.c.tokens_sampled), 0))
                                .where(SAMPLING.c.session_id == session_id)).one()
        return SessionDetail(found[0], list(runs), list(samplers), int(counts[0]), int(counts[1]), int(counts[2]))

    def sampling_records(self, session_id: str, from_ms: int, to_ms: int, after: tuple[int, int] | None,
                         limit: int) -> list[m.SamplingRecord]:
        """The session's records started in [from_ms, to_ms), in (start, id) order, after ``after``."""
        query = select(m.SamplingRecord).where(m.SamplingRecord.session_id == session_id, m.SamplingRecord.started_ms >= from_ms,
                                               m.SamplingRecord.started_ms < to_ms)
        if after is not None:
            started, row_id = after
            query = query.where((m.SamplingRecord.started_ms > started)
                                | ((m.SamplingRecord.started_ms == started) & (m.SamplingRecord.id > row_id)))
        with self.sessions() as db:
            return list(db.scalars(query.order_by(m.SamplingRecord.started_ms, m.SamplingRecord.id).limit(limit)))

    def sampling_buckets(self, session_id: str, from_ms: int, to_ms: int, bucket_ms: int) -> list[Bucket]:
        """The session's records started in [from_ms, to_ms), summed per bucket of ``bucket_ms`` from
        ``from_ms`` (the database groups them: at most one row per bucket comes back)."""
        index = (SAMPLING.c.started_ms - from_ms) // bucket_ms  # integer division (started_ms >= from_ms)
        query = (select(index.label("bucket"), func.count(), func.sum(SAMPLING.c.prompt_tokens), func.sum(SAMPLING.c.tokens_sampled),
                        func.sum(SAMPLING.c.answered_ms - SAMPLING.c.started_ms))
                 .where(SAMPLING.c.session_id == session_id, SAMPLING.c.started_ms >= from_ms, SAMPLING.c.started_ms < to_ms)
                 .group_by("bucket").order_by("bucket"))
        with self.engine.connect() as conn:
            return [Bucket(int(b), int(n), int(p or 0), int(t or 0), int(busy or 0)) for b, n, p, t, busy in conn.execute(query)]
