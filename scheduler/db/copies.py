"""The rows of a copied checkpoint (issue 33, copy_weights): a new closed session of the caller, a
training run in it and the checkpoint, with the audit entry, in one transaction (over a ``Store``).

The session is closed from the start, so the run takes no work: a copy is weights to sample from,
load into a new run (create_training_client_from_state) or download, as Tinker's copies are.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from temper.scheduler.db import models as m
from temper.scheduler.db.audit import Actor, record
from temper.scheduler.db.outage import database_errors, now


def new_session_id() -> str:
    return str(uuid.uuid4())


@database_errors
class CopyRecords:
    def __init__(self, store):
        self.store = store

    def add_copied_checkpoint(self, tenant: str, session_id: str, project_id: str, run: m.TrainingRun, checkpoint: m.Checkpoint,
                              source: str, actor: Actor | None, details: dict) -> m.Checkpoint:
        """The copy's session (closed; in ``project_id``, checked by the caller, when given), run and
        checkpoint, and its ``checkpoint.copy`` entry: all or none."""
        tenant_id = self.store.ensure_tenant(tenant)
        at: datetime = now()
        with self.store.sessions.begin() as db:
            db.add(m.Session(id=session_id, tenant_id=tenant_id, tags=["copy_weights"], user_metadata={}, created_at=at,
                             last_heartbeat_at=at, closed_at=at, close_status="success", num_training_runs=1,
                             project_id=project_id or None))
            db.flush()
            db.add(run)
            db.flush()  # the run's row before the checkpoint that references it
            db.add(checkpoint)
            record(db, actor, "checkpoint.copy", tenant, checkpoint.path, source=source, training_run_id=run.id,
                   size_bytes=checkpoint.size_bytes, expires_at=checkpoint.expires_at, project_id=project_id, **details)
        return checkpoint
