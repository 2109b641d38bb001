"""Each training run's in-flight target in the database (docs/async_rl.md): an in-flight save's
checkpoint row and the run's move to it, in one transaction; the target as stored.

A mixin of ``Store`` (same engine, one transaction per method)."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import select, update

from temper.common.errors import AlreadyExists, NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import database_errors


class StoredTarget(NamedTuple):
    version: int  # 0: the run has no in-flight save yet
    path: str     # "" then


@database_errors
class InflightStore:
    sessions = None  # sessionmaker, set by Store
    fence_runs = None  # set by Store (request_log.no_fence, or a replica's check)

    def add_inflight_checkpoint(self, run_id: str, name: str, path: str, size_bytes: int,
                                user_metadata: dict[str, str] | None = None) -> m.Checkpoint:
        """An in-flight save's checkpoint (ephemeral, a sampler checkpoint) with the run's next version,
        and the run's target moved to it, in one transaction: the row under lock, so concurrent saves
        of a run number their versions one after the other. A resent save (its answer was lost) gets
        the row it wrote then, with the same version, and moves nothing."""
        with self.sessions.begin() as db:
            self.fence_runs(db, {run_id})
            run = db.get(m.TrainingRun, run_id, with_for_update=True)
            if run is None:
                raise NotFound(f"training run {run_id!r} not found")
            existing = db.scalar(select(m.Checkpoint).where(m.Checkpoint.path == path))
            if existing is not None:
                if existing.inflight_version is None:
                    raise AlreadyExists(f"checkpoint {path} already exists")
                return existing
            # incremented in SQL, not from the value read: SQLite takes no row lock, its UPDATE serializes writers
            db.execute(update(m.TrainingRun).where(m.TrainingRun.id == run_id)
                       .values(inflight_version=m.TrainingRun.inflight_version + 1, inflight_path=path))
            version = db.scalar(select(m.TrainingRun.inflight_version).where(m.TrainingRun.id == run_id))
            row = m.Checkpoint(training_run_id=run_id, kind="sampler", name=name, path=path, size_bytes=size_bytes,
                               ephemeral=True, user_metadata=dict(user_metadata or {}), inflight_version=version)
            db.add(row)
            return row

    def inflight_target(self, run_id: str) -> StoredTarget:
        with self.sessions() as db:
            found = db.execute(select(m.TrainingRun.inflight_version, m.TrainingRun.inflight_path)
                               .where(m.TrainingRun.id == run_id)).first()
        if found is None:
            raise NotFound(f"training run {run_id!r} not found")
        return StoredTarget(int(found[0] or 0), found[1] or "")
