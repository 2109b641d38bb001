"""Lookups behind the API's listings and creation from a checkpoint: a tenant's runs a page at a
time, run rows by id, a readable checkpoint with its run, and run ids asked for by number.

A mixin of ``Store`` (same engine, one transaction per method). Another tenant's objects raise the
same NotFound as missing ones (tenancy.py)."""

from __future__ import annotations

from typing import Iterable, NamedTuple

from sqlalchemy import func, select, update

from temper.common.errors import AlreadyExists, NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.audit import Actor, record
from temper.scheduler.db.outage import database_errors


class RunNumber(NamedTuple):
    """A reserved run id, its number, and the session's counter before it (what give_back_run restores)."""
    run_id: str
    number: int
    previous: int


@database_errors
class CatalogStore:
    sessions = None  # sessionmaker, set by Store

    def reserve_run_id(self, session_id: str, index: int | None = None) -> str:
        return self.reserve_run(session_id, index).run_id

    def reserve_run(self, session_id: str, index: int | None = None) -> RunNumber:
        """Reserve "<session>:train:<n>": the next number, or ``index`` when no number at or above it
        was used (the ones skipped are never given out). The row is inserted by add_training_run."""
        with self.sessions.begin() as db:
            row = db.get(m.Session, session_id, with_for_update=True)
            if row is None:
                raise NotFound(f"session {session_id!r} not found")
            n = row.num_training_runs if index is None else index
            if n < row.num_training_runs:
                raise AlreadyExists(f"training run {session_id}:train:{n} already exists (this session's next number is "
                                    f"{row.num_training_runs})")
            previous, row.num_training_runs = row.num_training_runs, n + 1
            return RunNumber(f"{session_id}:train:{n}", n, previous)

    def give_back_run(self, session_id: str, number: RunNumber) -> bool:
        """Undo ``reserve_run`` for a creation that was refused and undone: the session's counter as it
        was, unless a later reservation moved it on (then the number stays skipped); whether it did."""
        with self.sessions.begin() as db:
            done = db.execute(update(m.Session).where(m.Session.id == session_id, m.Session.num_training_runs == number.number + 1)
                              .values(num_training_runs=number.previous))
            return done.rowcount == 1

    def add_imported_run(self, run: m.TrainingRun, checkpoints: list[m.Checkpoint], tenant: str = "",
                         actor: Actor | None = None) -> list[m.Checkpoint]:
        """A run made by an import and its checkpoints, in one transaction: all of them or none
        (with its audit entry, for ``tenant``: the session's owner)."""
        with self.sessions.begin() as db:
            db.add(run)
            db.flush()  # the run's row before the checkpoints that reference it
            db.add_all(checkpoints)
            record(db, actor, "checkpoint.import", tenant, checkpoints[0].path if checkpoints else run.id,
                   training_run_id=run.id, paths=" ".join(c.path for c in checkpoints),
                   size_bytes=sum(c.size_bytes or 0 for c in checkpoints))
            return checkpoints

    def tenant_runs(self, tenant: str, limit: int, offset: int, project_id: str = "") -> tuple[list[m.TrainingRun], int]:
        """A page of the tenant's training runs (with ``project_id``: of that project's sessions),
        newest first, and how many it has in all."""
        owned = (select(m.TrainingRun).join(m.Session, m.Session.id == m.TrainingRun.session_id)
                 .join(m.Tenant, m.Tenant.id == m.Session.tenant_id).where(m.Tenant.name == tenant))
        if project_id:
            owned = owned.where(m.Session.project_id == project_id)
        with self.sessions() as db:
            total = db.scalar(select(func.count()).select_from(owned.subquery())) or 0
            page = db.scalars(owned.order_by(m.TrainingRun.created_at.desc(), m.TrainingRun.id.desc()).limit(limit).offset(offset))
            return list(page), int(total)

    def run_rows(self, run_ids: Iterable[str]) -> dict[str, m.TrainingRun]:
        ids = sorted(set(run_ids))
        if not ids:
            return {}
        with self.sessions() as db:
            return {row.id: row for row in db.scalars(select(m.TrainingRun).where(m.TrainingRun.id.in_(ids)))}

    def readable_checkpoint_and_run(self, path: str, tenant: str) -> tuple[m.Checkpoint, m.TrainingRun]:
        """The checkpoint (the tenant's, or published by its owner) and the run that saved it."""
        row = self.readable_checkpoint(path, tenant)
        with self.sessions() as db:
            return row, db.get(m.TrainingRun, row.training_run_id)
