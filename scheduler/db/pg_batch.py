"""PostgreSQL forms of the hot path's writes: one statement for all the rows of a group commit or of
a cycle's outcomes, where the portable forms (``request_log.py``) send a statement per row or per run.

Each per-row statement costs the server a parse, a plan and an execution, and the scheduler a
parameter dict through SQLAlchemy; with a cycle of many runs they were most of the hot path's
statements (pg_stat_statements under ``benchmarks/scaleout.py --only ceiling``). Here the rows go
as one ``VALUES`` list of positional parameters through ``exec_driver_sql``, so errors still come
as SQLAlchemy's (``outage.py`` maps an outage to Unavailable, a duplicate is an IntegrityError).

Lock order: a transaction that updates ``training_runs`` rows first locks them in id order with one
``SELECT … ORDER BY id FOR NO KEY UPDATE``, as the per-run statements did by running in run order:
the group commit and a cycle's finish never wait on each other's runs crosswise.
"""

from __future__ import annotations

import json
from datetime import datetime

_LOCK_RUNS = "SELECT id, steps FROM training_runs WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE"
# The group's one time is a parameter of its own, not one per row: psycopg2 quotes a datetime at
# ~3 us, more than any other value of a row.
_INSERT_REQUESTS = ("INSERT INTO requests (training_run_id, seq_id, kind, payload_sha256, status, error, num_tokens, payload, "
                    "created_at, finished_at) SELECT v.*, %s::timestamptz, "
                    "CASE WHEN v.status = 'queued' THEN NULL ELSE %s::timestamptz END "
                    "FROM (VALUES {values}) AS v(run, seq, kind, sha, status, error, tokens, payload)")
_REQUEST_ROW = "(%s, %s::bigint, %s, %s, %s, %s::text, %s::bigint, %s::bytea)"
# The runs' dispatched watermarks (request_log.py: what "running" means); never moved down.
_MARK_DISPATCHED = ("UPDATE training_runs AS t SET dispatched_seq = v.seq FROM (VALUES {values}) AS v(run, seq) "
                    "WHERE t.id = v.run AND t.dispatched_seq < v.seq")
_KEY_ROW = "(%s, %s::bigint)"
# Only requests still queued or running are recorded, and the statement says which: a resent finish
# (its first commit's fate unknown) records nothing twice. (Rows are no longer set "running": the
# run's dispatched watermark says it. Rows an older scheduler left "running" are still open.)
_FINISH_OPEN = ("UPDATE requests AS r SET status = v.status, error = v.error, result = v.result, finished_at = %s::timestamptz "
                "FROM (VALUES {values}) AS v(run, seq, status, error, result) "
                "WHERE r.training_run_id = v.run AND r.seq_id = v.seq AND r.status IN ('queued', 'running') "
                "RETURNING r.training_run_id, r.seq_id")
_OUTCOME_ROW = "(%s, %s::bigint, %s, %s::text, %s::bytea)"
# From the run's previous cut on (its next_seq_id before this finish, less the same window): the rows
# below were cut by earlier finishes, so a long run's log is not walked again at every cycle.
_CUT_RESULTS = ("UPDATE requests AS r SET result = NULL FROM (VALUES {values}) AS v(run, cut, next), training_runs AS t "
                "WHERE t.id = v.run AND r.training_run_id = v.run AND r.seq_id >= t.next_seq_id - (v.next - v.cut) "
                "AND r.seq_id < v.cut AND r.result IS NOT NULL")
_CUT_ROW = "(%s, %s::bigint, %s::bigint)"
# with the run's next cycle's watermark (0: none), in the same row update
_COUNT_RUNS = ("UPDATE training_runs AS t SET next_seq_id = v.next, tokens_trained = t.tokens_trained + v.tokens, "
               "steps = t.steps + v.steps, last_request_at = COALESCE(v.at, t.last_request_at), "
               "dispatched_seq = GREATEST(t.dispatched_seq, v.dispatched) "
               "FROM (VALUES {values}) AS v(run, next, tokens, steps, at, dispatched) WHERE t.id = v.run")
_COUNT_ROW = "(%s, %s::bigint, %s::bigint, %s::bigint, %s::timestamptz, %s::bigint)"
METRIC_COLUMNS = ("training_run_id", "seq_id", "step", "kind", "status", "error", "loss", "num_tokens", "grad_norm",
                  "learning_rate", "metrics", "queued_seconds", "trainer_seconds", "cobatched_with", "trainer", "cycle",
                  "created_ms", "started_ms", "answered_ms")
# A request recorded again keeps its first metrics row (db/records.py).
_INSERT_METRICS = (f"INSERT INTO run_metrics ({', '.join(METRIC_COLUMNS)}) VALUES {{values}} "
                   "ON CONFLICT (training_run_id, seq_id) DO NOTHING")
_METRIC_ROW = "(" + ", ".join("%s::json" if c == "metrics" else "%s" for c in METRIC_COLUMNS) + ")"
# The same rows as one JSON array parameter: the driver quotes one string instead of 19 parameters a
# row (that quoting was the costliest part of a cycle's finish in the scheduler's CPU).
_INSERT_METRICS_JSON = (f"INSERT INTO run_metrics ({', '.join(METRIC_COLUMNS)}) SELECT {', '.join(METRIC_COLUMNS)} "
                        "FROM json_populate_recordset(NULL::run_metrics, %s) ON CONFLICT (training_run_id, seq_id) DO NOTHING")


def is_psycopg2(conn) -> bool:
    return conn.dialect.name == "postgresql" and conn.dialect.driver == "psycopg2"


def _many(conn, sql: str, row: str, rows: list[tuple], first: tuple = ()):
    """``sql`` with its ``{values}`` a list of ``len(rows)`` ``row`` templates, the rows' values flattened
    (after ``first``, the values of the parameters written before the list)."""
    return conn.exec_driver_sql(sql.format(values=", ".join([row] * len(rows))), (*first, *(v for r in rows for v in r)))


def lock_runs(conn, run_ids) -> dict[str, int]:
    """Lock the runs' rows in id order (every transaction that updates several runs' rows does so first:
    none waits on another's runs crosswise); returns each run's counted optimizer steps as locked."""
    return dict(conn.exec_driver_sql(_LOCK_RUNS, (sorted(set(run_ids)),)).all())


def insert_requests(conn, rows: list, at: datetime) -> None:
    """Admitted rows (``request_log.NewRequest``), in the caller's transaction. Their runs' rows are not
    written here (last_request_at moves with the outcomes): admissions and a cycle's finish never wait
    on each other's row locks."""
    if rows:
        _many(conn, _INSERT_REQUESTS, _REQUEST_ROW, [(r.run_id, r.seq_id, r.kind, r.sha, r.status, r.error, r.tokens, r.payload)
                                                     for r in rows], (at, at))


def mark_dispatched(conn, upto: dict[str, int]) -> None:
    """Each run's watermark up to ``upto[run]``, the runs' rows locked in order first."""
    if upto:
        lock_runs(conn, upto)
        _many(conn, _MARK_DISPATCHED, _KEY_ROW, sorted(upto.items()))


def finish_open(conn, outcomes: list, at: datetime) -> set[tuple[str, int]]:
    """Record (run, seq, status, error, result) outcomes of requests still open; the keys recorded."""
    if not outcomes:
        return set()
    return {(run_id, seq_id) for run_id, seq_id in _many(conn, _FINISH_OPEN, _OUTCOME_ROW, outcomes, (at,))}


def insert_metrics(conn, values: list[dict]) -> None:
    """run_metrics rows (``records.metric_values``' dicts, keyed by METRIC_COLUMNS)."""
    if not values:
        return
    try:
        rows = json.dumps(values, allow_nan=False)
    except (ValueError, TypeError):  # a NaN or infinite loss (JSON has no such number): the typed VALUES list carries it
        _many(conn, _INSERT_METRICS, _METRIC_ROW, [
            tuple(json.dumps(v[c]) if c == "metrics" else v[c] for c in METRIC_COLUMNS) for v in values])
        return
    conn.exec_driver_sql(_INSERT_METRICS_JSON, (rows,))


def count_runs(conn, runs: list[dict]) -> None:
    """Each run's results before its cut cleared and its counters moved (``request_log._finish_requests``'s
    dicts); the caller has locked the runs' rows (``lock_runs``)."""
    if runs:
        _many(conn, _CUT_RESULTS, _CUT_ROW, [(r["b_run"], r["b_cut"], r["b_next"]) for r in runs])
        _many(conn, _COUNT_RUNS, _COUNT_ROW, [(r["b_run"], r["b_next"], r["b_tokens"], r["b_steps"], r["b_at"], r.get("b_dispatched", 0))
                                              for r in runs])
