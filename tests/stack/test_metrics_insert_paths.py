"""pg_batch.insert_metrics on PostgreSQL: run_metrics rows sent as one JSON array (json_populate_recordset)
store exactly what the typed VALUES list (kept for a NaN or infinite loss, which JSON cannot carry) stores."""

from __future__ import annotations

import math

from sqlalchemy import text

from fixtures_stack import store_with_run
from temper.scheduler.db import pg_batch


def _row(run_id: str, seq: int, loss: float) -> dict:
    return dict(training_run_id=run_id, seq_id=seq, step=2, kind="forward_backward", status="done", error="bad 'x' \\ %s é",
                loss=loss, num_tokens=64, grad_norm=None, learning_rate=0.1 + 0.2, metrics={"loss:sum": 0.1 + 0.2, "n": 3},
                queued_seconds=0.001, trainer_seconds=1 / 3, cobatched_with=4, trainer="t:1", cycle=9, created_ms=2**41 + 1,
                started_ms=2**41 + 2, answered_ms=2**41 + 3)


def test_json_and_values_paths_store_the_same_rows(new_postgres_database):
    url = new_postgres_database("temper_metrics_paths")
    store, run_id = store_with_run(url)
    with store.engine.begin() as conn:
        pg_batch.insert_metrics(conn, [_row(run_id, 1, 1 / 3), _row(run_id, 2, 2.5)])             # JSON
        pg_batch.insert_metrics(conn, [_row(run_id, 3, 1 / 3), _row(run_id, 4, float("nan"))])    # VALUES (a NaN loss)
        pg_batch.insert_metrics(conn, [_row(run_id, 1, 9.0)])  # a request recorded again keeps its first row
    columns = ", ".join(c for c in pg_batch.METRIC_COLUMNS if c not in ("seq_id", "metrics")) + ", metrics::text"
    with store.engine.connect() as conn:
        got = {seq: rest for seq, *rest in conn.execute(text(f"select seq_id, {columns} from run_metrics order by seq_id"))}
    store.engine.dispose()
    loss = pg_batch.METRIC_COLUMNS.index("loss") - 1  # seq_id is not among the columns read
    assert got[1] == got[3]  # every column, floats bit for bit, the metrics JSON text as sent
    assert got[1][loss] == 1 / 3 and got[2][loss] == 2.5 and math.isnan(got[4][loss])
    assert got[1][-1] == '{"loss:sum": 0.30000000000000004, "n": 3}' and got[1][-2] == 2**41 + 3
