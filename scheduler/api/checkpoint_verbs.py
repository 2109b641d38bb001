"""The checkpoint verbs of the public API (removal itself: ``planning/checkpoint_removal.py``).

A checkpoint is its owner's: listing, publishing, TTL and deletion are the owner's alone; loading,
sampling and downloading also work for other tenants once the owner published it. Removal (by
DeleteCheckpoint, an expired TTL or an idle ephemeral snapshot) deletes the files on the trainer,
drops the adapter from every sampler, then deletes the row; a failure part way is retried whole.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from temper.common.checkpoints import parse_path
from temper.common.errors import InvalidArgument
from temper.scheduler.tenancy.auth import caller, caller_actor
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import now
from temper.scheduler.db.views import checkpoint_message
from temper.scheduler.planning.checkpoint_removal import remove_checkpoint
from temper.v1 import service_pb2

log = logging.getLogger(__name__)
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600


def check_ttl(ttl_seconds: int) -> int:
    if not 0 <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidArgument(f"ttl_seconds must be in [0, {MAX_TTL_SECONDS}] (0: no expiry), got {ttl_seconds}")
    return ttl_seconds


class CheckpointVerbs:
    """Mixed into TemperServicer (store, backends, runs come from it)."""

    async def ListCheckpoints(self, request, context):
        tenant = caller()
        if request.training_run_id:
            await self.runs.get(request.training_run_id, tenant)
            rows = await asyncio.to_thread(self.store.list_checkpoints, request.training_run_id, request.include_temporary)
        else:
            rows = await asyncio.to_thread(self.store.tenant_checkpoints, tenant, request.include_temporary)
        if request.project_ids:  # issue 33: NotFound for a project not the caller's
            in_projects = await asyncio.to_thread(self.store.project_run_ids, list(request.project_ids), tenant)
            rows = [r for r in rows if r.training_run_id in in_projects]
        runs = await asyncio.to_thread(self.store.run_rows, {r.training_run_id for r in rows})
        idle = timedelta(seconds=self.admission.settings.snapshot_idle_seconds)
        return service_pb2.ListCheckpointsResponse(checkpoints=[checkpoint_message(r, runs.get(r.training_run_id), idle)
                                                                for r in rows])

    async def GetCheckpoint(self, request, context):
        row, run = await asyncio.to_thread(self.store.readable_checkpoint_and_run, str(parse_path(request.path)), caller())
        return checkpoint_message(row, run)

    async def UpdateCheckpoint(self, request, context):
        path = str(parse_path(request.path))
        expires, ttl = False, None
        if request.HasField("ttl_seconds"):
            ttl = check_ttl(request.ttl_seconds)
            expires = now() + timedelta(seconds=ttl) if ttl else None
        published = request.published if request.HasField("published") else None
        row = await asyncio.to_thread(self.store.update_checkpoint, path, caller(), published, expires, caller_actor(), ttl)
        return checkpoint_message(row, await asyncio.to_thread(self.store.get_training_run, row.training_run_id))

    async def DeleteCheckpoint(self, request, context):
        await self.backends.wait_ready()
        row = await asyncio.to_thread(self.store.owned_checkpoint, str(parse_path(request.path)), caller())
        freed = await remove_checkpoint(self.store, self.backends, self.runs, row, caller_actor())
        log.info("deleted checkpoint %s (%d bytes)", row.path, freed)
        return service_pb2.DeleteCheckpointResponse(freed_bytes=freed)

    async def DownloadCheckpoint(self, request, context):
        await self.backends.wait_ready()
        path = parse_path(request.path)
        row = await asyncio.to_thread(self.store.readable_checkpoint, str(path), caller())
        run = await self.runs.get(row.training_run_id)
        async for chunk in self.backends.trainer_for(run.base_model, run.run_id).read_checkpoint(path.key):
            yield chunk


class CheckpointCollector:
    """Removes checkpoints past their TTL and idle ephemeral snapshots, every interval."""

    def __init__(self, store, backends, runs, settings):
        self.store, self.backends, self.runs, self.settings = store, backends, runs, settings

    async def collect_once(self) -> int:
        rows = await asyncio.to_thread(self.store.collectable_checkpoints, timedelta(seconds=self.settings.snapshot_idle_seconds))
        removed = 0
        for row in rows:
            try:
                await remove_checkpoint(self.store, self.backends, self.runs, row)
                removed += 1
            except Exception as exc:  # noqa: BLE001 - one checkpoint that cannot go now is tried on the next round
                log.warning("could not collect %s now: %r", row.path, exc)
        if removed:
            log.info("collected %d checkpoints (expired or idle snapshots)", removed)
        return removed

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_gc_interval_seconds)
            try:
                await self.backends.wait_ready()
                await self.collect_once()
            except Exception as exc:  # noqa: BLE001 - the collector must outlive a database or worker outage
                log.warning("checkpoint collection failed: %r", exc)
