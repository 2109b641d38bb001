"""The loop's side of the records kept after an answer (issue 22; the tables are ``db/records.py``):
stamp work as it goes to a trainer, turn answered work into run_metrics rows (written by
``SchedulerLoop.finish`` in the transaction of the outcomes), and prune the records periodically
(``metrics_retention_seconds``, ``metrics_max_rows_per_run``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from temper.common.errors import TemperError
from temper.common.retry import retry
from temper.scheduler.db.records import MetricRow, SamplingRow
from temper.scheduler.planning.group_commit import GroupCommit
from temper.scheduler.planning.work import Dispatch, Work

log = logging.getLogger(__name__)


def unix_ms() -> int:
    return int(time.time() * 1000)


def stamp(works: list[Work], trainer: str, cycle: int) -> None:
    """``works`` go to ``trainer`` now, in cycle ``cycle``, beside the work of how many other runs."""
    runs, at = {w.run_id for w in works}, unix_ms()
    for w in works:
        w.dispatch = Dispatch(trainer, cycle, len(runs) - 1, at)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def metric_rows(works: list[Work], outcomes: list) -> list[MetricRow]:
    """One row per answered work: its answer's metrics (none when it failed), its timing from its
    arrival (``submitted_at``, monotonic) and its dispatch."""
    answered, mono = unix_ms(), time.monotonic()
    rows = []
    for w, outcome in zip(works, outcomes):
        failed = isinstance(outcome, TemperError)
        answer = {} if failed else dict(getattr(outcome, "metrics", {}))
        created = answered - int((mono - w.submitted_at) * 1000) if w.submitted_at else answered
        d = w.dispatch or Dispatch("", 0, 0, answered)
        rows.append(MetricRow(
            w.run_id, w.seq_id, w.kind.value, "failed" if failed else "done",
            f"{outcome.code.name}: {outcome.message}" if failed else None,
            _finite(answer.get("loss:sum")), w.num_tokens, _finite(answer.get("grad_norm:mean")),
            _finite(answer.get("learning_rate:mean")), {k: v for k, v in answer.items() if math.isfinite(v)},
            d.cobatched_with, d.trainer, d.cycle, min(created, d.started_ms), d.started_ms, answered))
    return rows


async def prune_forever(store, retention_seconds: float, max_rows_per_run: int, every_seconds: float) -> None:
    """Deletes records past their retention every ``every_seconds`` (a database outage waits)."""
    while True:
        await asyncio.sleep(every_seconds)
        await prune_once(store, retention_seconds, max_rows_per_run)


async def prune_once(store, retention_seconds: float, max_rows_per_run: int) -> tuple[int, int]:
    before = unix_ms() - int(retention_seconds * 1000) if retention_seconds > 0 else 0
    deleted = await retry(lambda: asyncio.to_thread(store.prune_records, before, max_rows_per_run), seconds=None, first_delay=1.0,
                          what="the database is unavailable, retrying the records prune")
    if any(deleted):
        log.info("pruned %d run metric rows and %d sampling records", *deleted)
    return deleted


class SamplingRecorder(GroupCommit[SamplingRow]):
    """Group commit of sampling records (``Store.record_sampling``, with the sampling clients' token
    counters): the answers that arrive while a write is under way go together in the next one. A
    caller resumes once its record is committed (its answer then goes out); a database outage
    answers each caller of the group UNAVAILABLE, as the counter's own write did before."""

    def write_group(self, rows: list[SamplingRow]) -> list[BaseException | None]:
        self.store.record_sampling(rows)
        return [None] * len(rows)
