"""The durable request log: one ``requests`` row per sequenced request (admission writes it; the
loop records its outcome), and the adapter snapshots of trainer recovery
(``scheduler/planning/recovery.py``).

"Running" is a watermark, not a row write: before a cycle goes to a trainer its runs'
``training_runs.dispatched_seq`` moves up to the cycle's highest seq (``mark_running``; one run row
per cycle, usually in the previous cycle's finish). A row still "queued" at or below its run's
watermark may have been applied, exactly as a "running" row: every read here reports it as
"running" (``effective_status``), and only a "queued" row above it is one that never left the
scheduler. Rows written per verb (one INSERT or UPDATE of one row each): its request row's insert and
its outcome, its run_metrics row, and once its run is past ``durable_results_per_run`` one older row's
result cut; per cycle, shared by its verbs, its runs' training_runs rows (counters and the next cycle's
watermark in one update, or a second when the watermark moves in the request writer's transaction).

A mixin of ``Store`` (same engine, one transaction per method). The hot path (rows admitted
together, a cycle's outcomes) is SQLAlchemy Core on a connection, a few statements per
transaction whatever the number of rows: an ORM unit of work per request cost the scheduler more
CPU than everything else it does per request (benchmarks/README.md, scaleout). Admission writes each
state-changing request's serialized payload into its row; a run's latest snapshot is recorded on
its ``training_runs`` row, and the payloads it covers are cleared in the same transaction.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable, NamedTuple

from sqlalchemy import bindparam, func, insert, or_, select, tuple_, update
from sqlalchemy.exc import IntegrityError

from temper.common.errors import AlreadyExists, NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db import pg_batch
from temper.scheduler.db.outage import database_errors, now
from temper.scheduler.db.records import MetricRow, insert_run_metrics, metric_values

REQUESTS = m.RequestRecord.__table__
RUNS = m.TrainingRun.__table__
OPEN = ("queued", "running")
# The hot path's statements, built once: building and cache-keying them on every call cost the
# scheduler more CPU than executing them (benchmarks/README.md, scaleout). Values are bound per call.
_KEY = tuple_(REQUESTS.c.training_run_id, REQUESTS.c.seq_id)
_INSERT_REQUESTS = insert(REQUESTS)
# the watermark only moves up (a resent mark or finish, or an older cycle's, leaves it where it is)
_MARK_DISPATCHED = update(RUNS).where(RUNS.c.id == bindparam("b_run"), RUNS.c.dispatched_seq < bindparam("b_seq")).values(
    dispatched_seq=bindparam("b_seq"))
_STILL_OPEN = select(REQUESTS.c.training_run_id, REQUESTS.c.seq_id).where(
    _KEY.in_(bindparam("b_keys", expanding=True)), REQUESTS.c.status.in_(OPEN))
_FINISH = update(REQUESTS).where(  # no IN in executemany
    REQUESTS.c.training_run_id == bindparam("b_run"), REQUESTS.c.seq_id == bindparam("b_seq"),
    or_(*(REQUESTS.c.status == status for status in OPEN)))
_CUT_RESULTS = update(REQUESTS).where(REQUESTS.c.training_run_id == bindparam("b_run"), REQUESTS.c.seq_id < bindparam("b_cut"),
                                      REQUESTS.c.result.is_not(None)).values(result=None)
_COUNT_RUN = update(RUNS).where(RUNS.c.id == bindparam("b_run")).values(
    next_seq_id=bindparam("b_next"), tokens_trained=RUNS.c.tokens_trained + bindparam("b_tokens"),
    steps=RUNS.c.steps + bindparam("b_steps"), last_request_at=func.coalesce(bindparam("b_at"), RUNS.c.last_request_at))
_ONE = (REQUESTS.c.training_run_id == bindparam("b_run"), REQUESTS.c.seq_id == bindparam("b_seq"))
_STATUS = select(REQUESTS.c.status, RUNS.c.dispatched_seq).join(RUNS, RUNS.c.id == REQUESTS.c.training_run_id).where(
    *_ONE).with_for_update(of=REQUESTS)
_DISPATCHED = select(RUNS.c.dispatched_seq).where(RUNS.c.id == bindparam("b_run"))
_SKIP_QUEUED = update(REQUESTS).where(*_ONE, REQUESTS.c.status == "queued").values(
    status="skipped", kind="skipped", payload_sha256="", payload=None, error=bindparam("b_error"), finished_at=bindparam("b_at"))
_SKIPPED_FROM = select(REQUESTS.c.seq_id).where(REQUESTS.c.training_run_id == bindparam("b_run"),
                                                REQUESTS.c.seq_id >= bindparam("b_seq"), REQUESTS.c.status == "skipped")
ABANDONED = "abandoned by its client before it was recorded (AbandonSeq)"
# NO KEY UPDATE: it serializes snapshot records without waiting on the run's admissions, whose rows'
# foreign keys take KEY SHARE on the run (FOR UPDATE waited for them: 0.8-1.5 ms per snapshot under load)
_LOCK_SNAPSHOT = select(RUNS.c.snapshot_key, RUNS.c.snapshot_seq).where(RUNS.c.id == bindparam("b_run")).with_for_update(key_share=True)
_SET_SNAPSHOT = update(RUNS).where(RUNS.c.id == bindparam("b_run")).values(snapshot_key=bindparam("b_key"), snapshot_seq=bindparam("b_seq"))
_SET_RESTORING = update(RUNS).where(RUNS.c.id == bindparam("b_run")).values(restoring=bindparam("b_restoring"))
# From the previous snapshot's seq on: the payloads below it were cleared with it (a run's whole log is
# not walked again at every snapshot)
_CLEAR_PAYLOADS = update(REQUESTS).where(REQUESTS.c.training_run_id == bindparam("b_run"), REQUESTS.c.seq_id > bindparam("b_from"),
                                         REQUESTS.c.seq_id <= bindparam("b_seq"),
                                         REQUESTS.c.payload.is_not(None)).values(payload=None)


class NewRequest(NamedTuple):
    """A request row to add (``payload``: the serialized request, for replay after a trainer's death)."""
    run_id: str
    seq_id: int
    kind: str
    sha: str
    status: str
    tokens: int
    error: str | None = None
    payload: bytes | None = None


class LoggedRequest(NamedTuple):
    seq_id: int
    kind: str
    status: str
    num_tokens: int
    payload: bytes | None


def effective_status(status: str, seq_id: int, dispatched_seq: int) -> str:
    """A request row's status as every reader must take it: "queued" at or below its run's dispatched
    watermark is "running" (it may have reached the trainer)."""
    return "running" if status == "queued" and seq_id <= (dispatched_seq or 0) else status


def dispatched(keys) -> dict[str, int]:
    """run -> the highest of its seqs in ``keys``: the watermark a mark of these requests sets."""
    upto: dict[str, int] = {}
    for run_id, seq_id in keys:
        if seq_id > upto.get(run_id, 0):
            upto[run_id] = seq_id
    return upto


def no_fence(db, run_ids) -> None:
    """One scheduler owns every lane: nothing to check."""


@database_errors
class RequestLogStore:
    sessions = None  # sessionmaker, set by Store
    engine = None

    # Called first in every transaction that writes a lane's rows, with the runs written (Store sets
    # it: no_fence for one scheduler). Replicas (scheduler/cluster/) set a check that raises LeaseLost,
    # rolling the transaction back, unless this replica still holds each run's lane.
    fence_runs = None

    def get_request(self, run_id: str, seq_id: int) -> m.RequestRecord | None:
        """The row (detached), its status as ``effective_status`` reads it."""
        with self.sessions() as db:
            found = db.execute(select(m.RequestRecord, RUNS.c.dispatched_seq).join(RUNS, RUNS.c.id == m.RequestRecord.training_run_id)
                               .where(m.RequestRecord.training_run_id == run_id, m.RequestRecord.seq_id == seq_id)).first()
            if found is None:
                return None
            record, upto = found
            db.expunge(record)
        record.status = effective_status(record.status, record.seq_id, upto)
        return record

    def add_request(self, run_id: str, seq_id: int, kind: str, sha: str, status: str, tokens: int, error: str | None = None,
                    payload: bytes | None = None) -> None:
        outcome = self.add_requests([NewRequest(run_id, seq_id, kind, sha, status, tokens, error, payload)])[0]
        if outcome is not None:
            raise outcome

    def add_requests(self, rows: list[NewRequest]) -> list[AlreadyExists | None]:
        """Group commit: the rows in one transaction (one multi-row INSERT). Each row's outcome: None
        (added) or AlreadyExists (its (run, seq) has a row); a duplicate sends the others one by one."""
        try:
            with self.engine.begin() as conn:
                self.fence_runs(conn, {r.run_id for r in rows})
                self._insert_requests(conn, rows)
            return [None] * len(rows)
        except IntegrityError:
            if len(rows) == 1:
                return [AlreadyExists(f"request {rows[0].run_id} seq {rows[0].seq_id} was already submitted")]
        return [self.add_requests([row])[0] for row in rows]

    def write_group(self, rows: list[NewRequest], running: list[tuple[str, int]]) -> list[AlreadyExists | None]:
        """``mark_running`` and ``add_requests`` in one transaction: the group commit of the request
        writer (``group_commit.py``: the lanes' marks join the rows admitted meanwhile). A duplicate
        row sends the marks on in their own transaction, and the rows as add_requests does. The marks
        lock their runs' rows (in id order, as a finish does); the inserted rows' foreign keys only
        take KEY SHARE on theirs, which a finish's run update does not wait for."""
        try:
            with self.engine.begin() as conn:
                self.fence_runs(conn, {r.run_id for r in rows} | {run_id for run_id, _ in running})
                if running:  # run rows locked in id order, as finish_requests locks them: the two never deadlock
                    self._mark_running(conn, running)
                if rows:
                    self._insert_requests(conn, rows)
            return [None] * len(rows)
        except IntegrityError:
            pass
        if running:
            self.mark_running(running)
        return self.add_requests(rows) if rows else []

    @staticmethod
    def _insert_requests(conn, rows: list[NewRequest]) -> None:
        if not rows:
            return
        at = now()
        if pg_batch.is_psycopg2(conn):
            pg_batch.insert_requests(conn, rows, at)
            return
        conn.execute(_INSERT_REQUESTS, [
            dict(training_run_id=r.run_id, seq_id=r.seq_id, kind=r.kind, payload_sha256=r.sha, status=r.status, num_tokens=r.tokens,
                 error=r.error, created_at=at, finished_at=at if r.status != "queued" else None, payload=r.payload, result=None)
            for r in rows])

    def skip_request(self, run_id: str, seq_id: int, queued_too: bool) -> str:
        """Its client gave up on (run, seq): a "skipped" row where it has none (with ``queued_too``, also
        in place of a row left "queued", which never left the scheduler). Returns the row's status now."""
        with self.engine.begin() as conn:
            self.fence_runs(conn, {run_id})
            row = conn.execute(_STATUS, {"b_run": run_id, "b_seq": seq_id}).first()
            if row is None:
                self._insert_requests(conn, [NewRequest(run_id, seq_id, "skipped", "", "skipped", 0, ABANDONED)])
                return "skipped"
            found = effective_status(row[0], seq_id, row[1])  # queued under the watermark: may have been applied
            if found == "queued" and queued_too:
                conn.execute(_SKIP_QUEUED, {"b_run": run_id, "b_seq": seq_id, "b_at": now(), "b_error": ABANDONED})
                return "skipped"
        return found

    def skipped_seqs(self, run_id: str, from_seq: int) -> tuple[int, ...]:
        """The run's seqs from ``from_seq`` on that their clients gave up on (skip_request)."""
        with self.engine.connect() as conn:
            return tuple(conn.execute(_SKIPPED_FROM, {"b_run": run_id, "b_seq": from_seq}).scalars())

    def mark_running(self, keys: Iterable[tuple[str, int]]) -> None:
        """(run, seq) requests are about to go to a trainer: their runs' watermarks move up to them.
        After a crash, "running" (queued at or below the watermark) means the outcome is unknown;
        "queued" above it means it never left the scheduler. ``keys`` of a run are the next of its
        queue in seq order (loop.py), so the seqs under a watermark are all dispatched or answered."""
        keys = list(keys)
        with self.engine.begin() as conn:
            self.fence_runs(conn, {run_id for run_id, _ in keys})
            self._mark_running(conn, keys)

    @staticmethod
    def _mark_running(conn, keys: list[tuple[str, int]]) -> None:
        upto = dispatched(keys)
        if not upto:
            return
        if pg_batch.is_psycopg2(conn):
            pg_batch.mark_dispatched(conn, upto)
        else:
            conn.execute(_MARK_DISPATCHED, [dict(b_run=run_id, b_seq=seq) for run_id, seq in sorted(upto.items())])

    def finish_requests(self, outcomes: Iterable[tuple[str, int, str, str | None, bytes | None]], trained_tokens: dict[str, int],
                        steps: dict[str, int], next_seq: dict[str, int], result_window: int = 0,
                        metrics: list[MetricRow] = (), running: list[tuple[str, int]] = ()) -> None:
        """Record (run, seq, status, error, serialized result) outcomes and the runs' counters in one
        transaction; results older than each run's last ``result_window`` seqs are cleared. ``running``:
        requests marked running in the same transaction (the lane's next cycle, ``mark_running``), so
        that cycle needs no transaction of its own before it goes to the trainer; on PostgreSQL its
        watermark moves in the same run row update as the counters.

        Safe to call again after an error whose commit may nevertheless have happened (the loop
        resends it): only requests still queued or running are recorded, and a run's counters move
        only with them, so a resent call that finds its outcomes recorded counts nothing twice.
        ``metrics``: the requests' rows of run_metrics (db/records.py), written with their outcomes; a
        run's last_request_at becomes the arrival of its newest request recorded now."""
        outcomes = list(outcomes)
        with self.engine.begin() as conn:
            self.fence_runs(conn, {o[0] for o in outcomes} | set(next_seq) | {run_id for run_id, _ in running})
            upto = dispatched(running)
            if pg_batch.is_psycopg2(conn):  # a run of next_seq gets its watermark in its counters' update
                self._finish_requests(conn, outcomes, trained_tokens, steps, next_seq, result_window, metrics, upto)
                upto = {run_id: seq for run_id, seq in upto.items() if run_id not in next_seq}
            else:
                self._finish_requests(conn, outcomes, trained_tokens, steps, next_seq, result_window, metrics)
            if upto:
                self._mark_running(conn, list(upto.items()))

    @staticmethod
    def _finish_requests(conn, outcomes, trained_tokens: dict[str, int], steps: dict[str, int], next_seq: dict[str, int],
                         result_window: int = 0, metrics: list[MetricRow] = (), upto: dict[str, int] | None = None) -> None:
        outcomes, at = list(outcomes), now()
        if pg_batch.is_psycopg2(conn):
            still_open = pg_batch.finish_open(conn, outcomes, at)
            # the runs written below locked once, in id order, their counted steps read with the lock: the
            # metrics rows' steps, before the counters move (one statement, where a Core SELECT with an
            # expanding IN and a separate lock cost the scheduler ~1 ms of CPU per cycle)
            runs_written = set(next_seq) | {r.run_id for r in metrics}
            counted_steps = pg_batch.lock_runs(conn, runs_written) if runs_written else {}
            if metrics:
                pg_batch.insert_metrics(conn, metric_values(metrics, still_open, counted_steps))
        else:
            still_open = set(map(tuple, conn.execute(_STILL_OPEN, {"b_keys": [(run_id, seq_id) for run_id, seq_id, *_ in outcomes]})))
            rows = [dict(b_run=run_id, b_seq=seq_id, status=status, error=error, result=result, finished_at=at)
                    for run_id, seq_id, status, error, result in outcomes if (run_id, seq_id) in still_open]
            if rows:
                conn.execute(_FINISH, rows)
            if metrics:  # their steps from the run counters, before these move
                insert_run_metrics(conn, metrics, still_open)
        counted = {run_id for run_id, _ in still_open}
        newest: dict[str, int] = {}  # run -> unix ms of its newest request recorded now
        for r in metrics:
            if (r.run_id, r.seq_id) in still_open:
                newest[r.run_id] = max(newest.get(r.run_id, 0), r.created_ms)
        runs = [dict(b_run=run_id, b_cut=seq - result_window, b_next=seq, b_dispatched=(upto or {}).get(run_id, 0),
                     b_tokens=trained_tokens.get(run_id, 0) if run_id in counted else 0,
                     b_steps=steps.get(run_id, 0) if run_id in counted else 0, b_at=_utc(newest[run_id]) if run_id in newest else None)
                for run_id, seq in sorted(next_seq.items())]
        if pg_batch.is_psycopg2(conn):
            pg_batch.count_runs(conn, runs)  # their rows locked above
        elif runs:
            conn.execute(_CUT_RESULTS, runs)
            conn.execute(_COUNT_RUN, runs)

    def logged_requests(self, run_id: str, after_seq: int, upto_seq: int) -> list[LoggedRequest]:
        """The run's requests with after_seq < seq <= upto_seq, in seq order."""
        with self.sessions() as db:
            rows = db.execute(select(m.RequestRecord.seq_id, m.RequestRecord.kind, m.RequestRecord.status,
                                     m.RequestRecord.num_tokens, m.RequestRecord.payload)
                              .where(m.RequestRecord.training_run_id == run_id, m.RequestRecord.seq_id > after_seq,
                                     m.RequestRecord.seq_id <= upto_seq).order_by(m.RequestRecord.seq_id)).all()
            upto = db.execute(_DISPATCHED, {"b_run": run_id}).scalar() or 0
        return [LoggedRequest(seq, kind, effective_status(status, seq, upto), tokens, payload) for seq, kind, status, tokens, payload in rows]

    def record_snapshot(self, run_id: str, key: str, seq: int) -> str | None:
        """The run's latest snapshot is now ``key``, holding seqs <= ``seq`` applied: payloads up to it
        are cleared. Returns the snapshot it replaces (its files are the caller's to delete), if any."""
        with self.engine.begin() as conn:
            self.fence_runs(conn, {run_id})
            found = conn.execute(_LOCK_SNAPSHOT, {"b_run": run_id}).first()
            if found is None:
                raise NotFound(f"training run {run_id!r} not found")
            conn.execute(_SET_SNAPSHOT, {"b_run": run_id, "b_key": key, "b_seq": seq})
            conn.execute(_CLEAR_PAYLOADS, {"b_run": run_id, "b_from": found[1] or 0, "b_seq": seq})
        previous = found[0]
        return previous if previous != key else None

    def set_restoring(self, run_id: str, restoring: bool) -> None:
        """Mark the run's adapter as being rebuilt (True) or rebuilt (False): models.TrainingRun.restoring."""
        with self.engine.begin() as conn:
            self.fence_runs(conn, {run_id})
            conn.execute(_SET_RESTORING, {"b_run": run_id, "b_restoring": restoring})

    def move_run(self, run_id: str, trainer: str) -> None:
        """The run's adapter now lives on ``trainer`` (restored there after its trainer died)."""
        with self.sessions.begin() as db:
            self.fence_runs(db, {run_id})  # its old lane's owner moves it
            db.execute(update(m.TrainingRun).where(m.TrainingRun.id == run_id).values(trainer=trainer))


def _utc(unix_ms: int) -> datetime:
    return datetime.fromtimestamp(unix_ms / 1000, timezone.utc)
