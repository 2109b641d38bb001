"""A cycle's outcomes on a real Postgres (request_log.finish_requests): its one-statement path records
only the requests still open, moves counters only with them, clears results out of the window, and
marks the next cycle's requests running in the same transaction (their run's dispatched watermark);
the portable path (SQLite) agrees."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import store_with_run
from temper.scheduler.db.records import MetricRow
from temper.scheduler.db.store import Store

# a row's status as the store reads it: queued at or below the run's dispatched watermark is running
EFFECTIVE_STATUS = "case when r.status = 'queued' and r.seq_id <= t.dispatched_seq then 'running' else r.status end"


def _store_with_requests(url: str) -> tuple[Store, str]:
    store, run_id = store_with_run(url)
    for seq, kind in enumerate(("forward_backward", "optim_step", "forward_backward", "optim_step", "forward_backward"), 1):
        store.add_request(run_id, seq, kind, f"sha{seq}", "queued", 6 if kind == "forward_backward" else 0)
    return store, run_id


def _rows(url: str, run_id: str) -> dict[int, tuple]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text(f"select seq_id, {EFFECTIVE_STATUS}, error, result, finished_at is not null from requests r "
                                 "join training_runs t on t.id = r.training_run_id where r.training_run_id = :r order by seq_id"),
                            {"r": run_id}).all()
        counters = conn.execute(text("select tokens_trained, steps, next_seq_id from training_runs where id = :r"),
                                {"r": run_id}).one()
    engine.dispose()
    return {seq: (status, error, bytes(result) if result is not None else None, finished) for seq, status, error, result, finished in rows}, tuple(counters)


def _finish_two_cycles(store: Store, run_id: str) -> None:
    store.mark_running([(run_id, 1), (run_id, 2)])
    # cycle 1: seq 1 done, seq 2 refused; seqs 3 and 4 (its next cycle) marked running with it
    store.finish_requests([(run_id, 1, "done", None, b"fb1"), (run_id, 2, "failed", "bad 'step' \\ %s", None)],
                          {run_id: 6}, {}, {run_id: 3}, result_window=1, running=[(run_id, 3), (run_id, 4)])
    # the same outcomes resent (a commit whose answer was lost), with seq 3's: only seq 3 is still open
    store.finish_requests([(run_id, 1, "done", None, b"other"), (run_id, 3, "done", None, b"\x00fb3\xff")],
                          {run_id: 12}, {}, {run_id: 4}, result_window=1)


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_finish_records_open_requests_once_and_marks_the_next_cycle(backend, new_postgres_database, tmp_path):
    url = new_postgres_database("temper_finish") if backend == "postgresql" else f"sqlite:///{tmp_path / 'finish.db'}"
    store, run_id = _store_with_requests(url)
    _finish_two_cycles(store, run_id)
    rows, counters = _rows(url, run_id)
    assert rows[1] == ("done", None, None, True)  # cleared: out of the 1-result window once seq 3 finished
    assert rows[2] == ("failed", "bad 'step' \\ %s", None, True)
    assert rows[3] == ("done", None, b"\x00fb3\xff", True)  # the second call's answer, bytes as sent
    assert rows[4] == ("running", None, None, False)  # marked ahead with cycle 1, not yet answered
    assert rows[5] == ("queued", None, None, False)
    # tokens: 6 from the first call, 12 from the second (it recorded seq 3); steps: none succeeded
    assert counters == (18, 0, 4)
    store.engine.dispose()


def test_finish_with_nothing_open_counts_nothing(new_postgres_database):
    url = new_postgres_database("temper_finish")
    store, run_id = _store_with_requests(url)
    store.finish_requests([(run_id, 1, "done", None, b"a")], {run_id: 6}, {run_id: 0}, {run_id: 2}, result_window=8)
    store.finish_requests([(run_id, 1, "done", None, b"b")], {run_id: 6}, {run_id: 0}, {run_id: 2}, result_window=8)
    rows, counters = _rows(url, run_id)
    assert rows[1][2] == b"a" and counters == (6, 0, 2)
    store.engine.dispose()


def test_results_are_cut_from_the_previous_cut_on(new_postgres_database):
    """A finish clears the results that left the window since the run's previous finish, and walks no
    further back: a row below the previous cut is not looked at again (a long run's log is not
    scanned at every cycle). Seeded here with a result the previous cut would have cleared."""
    url = new_postgres_database("temper_finish_cut")
    store, run_id = _store_with_requests(url)
    store.finish_requests([(run_id, s, "done", None, b"r%d" % s) for s in (1, 2, 3)], {run_id: 12}, {run_id: 1}, {run_id: 4},
                          result_window=2)
    rows, _ = _rows(url, run_id)
    assert [rows[s][2] for s in (1, 2, 3)] == [None, b"r2", b"r3"]  # cut below 4 - 2
    engine = create_engine(url)
    with engine.begin() as conn:  # a result below the cut of 2: the next finish must not walk back to it
        conn.execute(text("update requests set result = 'stale' where training_run_id = :r and seq_id = 1"), {"r": run_id})
    engine.dispose()
    store.finish_requests([(run_id, s, "done", None, b"r%d" % s) for s in (4, 5)], {run_id: 6}, {run_id: 1}, {run_id: 6},
                          result_window=2)
    rows, counters = _rows(url, run_id)
    assert [rows[s][2] for s in (1, 2, 3, 4, 5)] == [b"stale", None, None, b"r4", b"r5"] and counters[2] == 6
    store.engine.dispose()


def test_a_snapshot_clears_payloads_from_the_previous_snapshot_on(new_postgres_database):
    """record_snapshot clears the logged payloads its snapshot covers, from the previous snapshot's seq on."""
    url = new_postgres_database("temper_snapshot_clear")
    store, run_id = store_with_run(url)
    for seq in range(1, 7):
        store.add_request(run_id, seq, "forward_backward", f"sha{seq}", "queued", 6, payload=b"p%d" % seq)
    assert store.record_snapshot(run_id, "k2", 2) is None
    engine = create_engine(url)
    with engine.begin() as conn:  # below the first snapshot: the second one must not walk back to it
        conn.execute(text("update requests set payload = 'stale' where training_run_id = :r and seq_id = 1"), {"r": run_id})
    assert store.record_snapshot(run_id, "k5", 5) == "k2"
    with engine.connect() as conn:
        payloads = dict(conn.execute(text("select seq_id, payload from requests where training_run_id = :r"), {"r": run_id}).all())
    engine.dispose()
    assert {seq: bytes(p) if p is not None else None for seq, p in payloads.items()} == {
        1: b"stale", 2: None, 3: None, 4: None, 5: None, 6: b"p6"}
    store.engine.dispose()


def test_last_request_at_moves_with_the_requests_recorded(new_postgres_database):
    """A run's last_request_at becomes the arrival of its newest request recorded by the finish (its
    run_metrics row's created_ms); a resent finish that records nothing leaves it."""
    url = new_postgres_database("temper_finish_last")
    store, run_id = _store_with_requests(url)
    created = [1_800_000_000_000 + 1000 * s for s in (1, 2)]
    rows = [MetricRow(run_id, s, "forward_backward", "done", None, 1.0, 6, None, None, {}, 0, "t:1", 1, ms, ms, ms + 5)
            for s, ms in zip((1, 2), created)]
    outcomes = [(run_id, s, "done", None, b"r") for s in (1, 2)]
    store.finish_requests(outcomes, {run_id: 12}, {run_id: 0}, {run_id: 3}, metrics=rows)
    store.finish_requests(outcomes, {run_id: 12}, {run_id: 0}, {run_id: 3}, metrics=rows[:1])  # resent: recorded already
    engine = create_engine(url)
    with engine.connect() as conn:
        at = conn.execute(text("select last_request_at from training_runs where id = :r"), {"r": run_id}).scalar_one()
    engine.dispose()
    assert at == datetime.fromtimestamp(created[1] / 1000, timezone.utc)
    store.engine.dispose()
