"""The one way a checkpoint is removed (DeleteCheckpoint, an expired TTL, an idle ephemeral snapshot):
files on the trainer, then the sampler copies, then the row — in that order, so a failure part way
leaves a row that can be deleted again."""

from __future__ import annotations

import asyncio

from temper.common.checkpoints import parse_path
from temper.scheduler.db import models as m


async def remove_checkpoint(store, backends, runs, row: m.Checkpoint, actor=None) -> int:
    """Files, sampler copies, row — in that order, so a failure leaves a row that can be deleted again.
    ``actor``: who deletes it, for the audit log (None: the collector, for an expired TTL)."""
    run = await runs.get(row.training_run_id)
    key = parse_path(row.path).key
    freed = await backends.trainer_for(run.base_model, run.run_id).delete_checkpoint(key)
    await backends.forget_checkpoint(key)
    reason = "" if actor is not None else "unused temporary checkpoint" if row.ephemeral else "ttl expired"
    await asyncio.to_thread(store.delete_checkpoint_row, row.id, actor, reason)
    return freed
