"""The durable request log and adapter snapshots of trainer recovery (``scheduler/recovery.py``).

A mixin of ``Store`` (same engine, one transaction per method). Admission writes each
state-changing request's serialized payload into its ``requests`` row (``Store.add_request``); a
run's latest snapshot is recorded on its ``training_runs`` row, and the payloads it covers are
cleared in the same transaction.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import select, update

from temper.common.errors import NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import database_errors


class LoggedRequest(NamedTuple):
    seq_id: int
    kind: str
    status: str
    num_tokens: int
    payload: bytes | None


@database_errors
class RequestLogStore:
    sessions = None  # sessionmaker, set by Store

    def logged_requests(self, run_id: str, after_seq: int, upto_seq: int) -> list[LoggedRequest]:
        """The run's requests with after_seq < seq <= upto_seq, in seq order."""
        with self.sessions() as db:
            rows = db.execute(select(m.RequestRecord.seq_id, m.RequestRecord.kind, m.RequestRecord.status,
                                     m.RequestRecord.num_tokens, m.RequestRecord.payload)
                              .where(m.RequestRecord.training_run_id == run_id, m.RequestRecord.seq_id > after_seq,
                                     m.RequestRecord.seq_id <= upto_seq).order_by(m.RequestRecord.seq_id)).all()
        return [LoggedRequest(*row) for row in rows]

    def record_snapshot(self, run_id: str, key: str, seq: int) -> str | None:
        """The run's latest snapshot is now ``key``, holding seqs <= ``seq`` applied: payloads up to it
        are cleared. Returns the snapshot it replaces (its files are the caller's to delete), if any."""
        with self.sessions.begin() as db:
            run = db.get(m.TrainingRun, run_id, with_for_update=True)
            if run is None:
                raise NotFound(f"training run {run_id!r} not found")
            previous = run.snapshot_key
            run.snapshot_key, run.snapshot_seq = key, seq
            db.execute(update(m.RequestRecord).where(
                m.RequestRecord.training_run_id == run_id, m.RequestRecord.seq_id <= seq,
                m.RequestRecord.payload.is_not(None)).values(payload=None))
        return previous if previous != key else None

    def move_run(self, run_id: str, trainer: str) -> None:
        """The run's adapter now lives on ``trainer`` (restored there after its trainer died)."""
        with self.sessions.begin() as db:
            db.execute(update(m.TrainingRun).where(m.TrainingRun.id == run_id).values(trainer=trainer))
