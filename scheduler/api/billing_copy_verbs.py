"""GetBillingUsage and CopyCheckpoint (issue 33: the SDK's get_billing_usage and copy_weights).

GetBillingUsage sums the caller's own usage per UTC hour (``db/billing.py``); prices are the
gateway's (its operator's price table), so this answers quantities only.

CopyCheckpoint copies a checkpoint the caller can read (its own, or one another tenant published) to
a new checkpoint of the caller (in the caller's project named, if any): the trainer holding the source links (or copies) its files under the
new key, then the copy's closed session, run and checkpoint rows are written with the audit entry in
one transaction (``db/copies.py``). A refusal changes nothing; a failure after the files were made
removes them. The copy counts against the caller's max_storage_bytes as a save does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

from temper.common.billing import check_window
from temper.common.checkpoints import CheckpointPath, parse_path
from temper.common.errors import InvalidArgument
from temper.scheduler.api.checkpoint_verbs import MAX_TTL_SECONDS
from temper.scheduler.db import models as m
from temper.scheduler.db.billing import BillingReader
from temper.scheduler.db.copies import CopyRecords, new_session_id
from temper.scheduler.db.outage import now
from temper.scheduler.db.views import checkpoint_message
from temper.scheduler.planning.runs import undo_creation
from temper.scheduler.tenancy.auth import caller, caller_actor
from temper.scheduler.tenancy.quotas import check_hard_limit
from temper.v1 import service_pb2, trainer_pb2

log = logging.getLogger(__name__)
MIN_COPY_TTL_SECONDS = 3600  # the SDK's copy_weights: 1 hour to 10 years


def check_copy_ttl(ttl_seconds: int) -> int:
    """0: no expiry; else within the SDK's [1 hour, 10 years]."""
    if ttl_seconds and not MIN_COPY_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidArgument(f"ttl_seconds must be in [{MIN_COPY_TTL_SECONDS}, {MAX_TTL_SECONDS}], or unset for no "
                              f"expiry; got {ttl_seconds}")
    return ttl_seconds


class BillingCopyVerbs:
    """Mixed into TemperServicer (store, backends, admission come from it)."""

    async def GetBillingUsage(self, request, context):
        tenant = caller()
        now_ms = int(time.time() * 1000)
        check_window(request.from_unix_ms, request.to_unix_ms, now_ms)
        rows = await asyncio.to_thread(BillingReader(self.store).billing_usage, tenant, request.from_unix_ms,
                                       request.to_unix_ms, now_ms)
        return service_pb2.GetBillingUsageResponse(buckets=[service_pb2.BillingBucket(
            bucket_start_unix_ms=r.hour_ms, base_model=r.base_model, session_id=r.session_id, kind=r.kind,
            token_count=r.token_count, count=r.count, gigabyte_hours=r.gigabyte_hours) for r in rows])

    async def CopyCheckpoint(self, request, context):
        await self.backends.wait_ready()
        tenant = caller()
        source = parse_path(request.source_path)  # malformed: INVALID_ARGUMENT
        ttl = check_copy_ttl(request.ttl_seconds)
        if request.project_id:  # the copy's project: one of the caller's (another tenant's: NOT_FOUND, as a missing one)
            await asyncio.to_thread(self.store.check_projects, [request.project_id], tenant)
        if request.session_id:  # another tenant's or a missing session: NOT_FOUND
            await asyncio.to_thread(self.store.open_session, request.session_id, tenant)
        row, run = await asyncio.to_thread(self.store.readable_checkpoint_and_run, str(source), tenant)
        # Shielded: a caller that goes away leaves the copy made whole or undone, never half made.
        return await asyncio.shield(asyncio.ensure_future(self._copy_within_limits(request, tenant, source, row, run, ttl)))

    async def _copy_within_limits(self, request, tenant: str, source: CheckpointPath, row: m.Checkpoint, run: m.TrainingRun,
                                  ttl: int) -> object:
        async with self.admission.quotas.storage_lock(tenant):
            limits = await self.admission.quotas.limits(tenant)
            if limits.max_storage_bytes:  # a link still holds the bytes for as long as the copy lives
                used = await asyncio.to_thread(self.store.storage_bytes, tenant)
                check_hard_limit("max_storage_bytes", limits.max_storage_bytes, used, adding=row.size_bytes or 0)
            return await self._copy(request, tenant, source, row, run, ttl)

    async def _copy(self, request, tenant: str, source: CheckpointPath, row: m.Checkpoint, run: m.TrainingRun, ttl: int):
        records = CopyRecords(self.store)
        session_id = new_session_id()
        run_id = f"{session_id}:train:0"
        dest = CheckpointPath(run_id, source.kind, source.name)
        trainer = self.backends.trainer_for(run.base_model, run.id)
        copied = await trainer.call("CopyCheckpoint", trainer_pb2.CopyCheckpointFilesRequest(source_key=source.key,
                                                                                             checkpoint_key=dest.key))
        try:
            new_run = m.TrainingRun(
                id=run_id, session_id=session_id, base_model=run.base_model, lora_rank=run.lora_rank, lora_alpha=run.lora_alpha,
                lora_dropout=run.lora_dropout, lora_expert_rank=run.lora_expert_rank, deterministic=run.deterministic,
                seed=run.seed, train_attn=run.train_attn, train_mlp=run.train_mlp, train_unembed=run.train_unembed,
                user_metadata={}, next_seq_id=1, trainer=trainer.address, snapshot_key=None, snapshot_seq=None)
            checkpoint = m.Checkpoint(training_run_id=run_id, kind=row.kind, name=row.name, path=str(dest),
                                      size_bytes=copied.size_bytes, user_metadata=dict(row.user_metadata or {}),
                                      expires_at=now() + timedelta(seconds=ttl) if ttl else None)
            details = {"requested_by_session": request.session_id} if request.session_id else {}
            await asyncio.to_thread(records.add_copied_checkpoint, tenant, session_id, request.project_id, new_run, checkpoint,
                                    row.path, caller_actor(), details)
        except BaseException:
            await undo_creation(trainer, None, [dest.key])
            raise
        self.backends.remember_placement(run_id, trainer.address)
        log.info("copied %s to %s for %s (%d bytes)", row.path, dest, tenant, copied.size_bytes)
        return checkpoint_message(checkpoint, new_run)
