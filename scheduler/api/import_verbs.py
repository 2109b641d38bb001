"""ImportCheckpoint: a peft LoRA adapter trained elsewhere becomes a training run of the caller and its
checkpoint(s), served as the runs' own are (sampling, load_state, download, publishing).

The scheduler checks the header (name, metadata, the caller's open session), receives the files
whole (at most ``max_import_bytes``), checks the caller's hard limits, then has a trainer of the
adapter's base model check the files with the rules of its own checkpoints and write them
(``Trainer.ImportAdapter``). The new run's adapter is loaded from them, the training checkpoint and
first snapshot are written, and the run and checkpoint rows are added in one transaction. A refusal
or failure at any step undoes the steps before it: a refused import leaves no run row, checkpoint
row, file or folder, and gives its run number back to the session (kept skipped only when the
trainer could not be told to remove what it made).
"""

from __future__ import annotations

import asyncio
import json
import logging

from temper.common.checkpoints import WEIGHT_FILES, CheckpointPath, check_name
from temper.common.errors import InvalidArgument, NotFound
from temper.common.strings import shown
from temper.common.uploads import FileAssembly
from temper.scheduler.tenancy.auth import caller, caller_actor
from temper.scheduler.workers.backends import TrainerHandle
from temper.scheduler.db import models as m
from temper.scheduler.api.lookup_verbs import check_user_metadata
from temper.scheduler.api.stream_header import first_header
from temper.scheduler.tenancy.quotas import check_hard_limit
from temper.scheduler.planning.recovery import snapshot_key
from temper.scheduler.planning.runs import created_expert_rank, give_back_run, new_run_row, undo_creation
from temper.scheduler.db.views import KIND_NAMES, checkpoint_message
from temper.v1 import service_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)
CONFIG_FILE = WEIGHT_FILES[0]  # adapter_config.json
MAX_CONFIG_BYTES = 64 << 10    # the trainer's limit (services/trainer/imports.py): refused here before parsing


def adapter_base_model(config: bytes) -> str:
    """The base model an adapter is for: its adapter_config.json's base_model_name_or_path."""
    if len(config) > MAX_CONFIG_BYTES:
        raise InvalidArgument(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        value = json.loads(config).get("base_model_name_or_path")
    except (ValueError, AttributeError, RecursionError):  # RecursionError: nested too deep
        raise InvalidArgument(f"{CONFIG_FILE} is not a JSON object") from None
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{CONFIG_FILE} names no base_model_name_or_path")
    return value


class ImportVerbs:
    """Mixed into TemperServicer (store, backends, runs, admission, _creating_runs, _run_info come from it)."""

    async def ImportCheckpoint(self, request_iterator, context):
        await self.backends.wait_ready()
        tenant = caller()
        messages = request_iterator.__aiter__()
        header = await self._import_header(messages, tenant)
        upload = FileAssembly(WEIGHT_FILES, self.admission.settings.max_import_bytes)
        async for message in messages:
            if message.WhichOneof("payload") != "file":
                raise InvalidArgument("only the first ImportCheckpoint message is a header; the others carry files")
            upload.add(message.file)
        files = upload.files()
        base_model = adapter_base_model(files[CONFIG_FILE])
        try:
            trainer = self.backends.place(base_model)
        except NotFound:
            raise InvalidArgument(f"the adapter is for base model {shown(base_model)}, which no trainer here serves; "
                                  f"served: {self.backends.model_names()}") from None
        # Shielded: a caller that goes away leaves the import made whole or undone, never half made.
        return await asyncio.shield(asyncio.ensure_future(self._import_within_limits(header, tenant, base_model, trainer, files)))

    async def _import_header(self, messages, tenant: str) -> service_pb2.ImportCheckpointHeader:
        """The first message's header, checked: a name, bounded metadata, an open session of the caller's."""
        header = await first_header(messages, "ImportCheckpoint", "an import")
        check_name(header.name)
        check_user_metadata(header.user_metadata)
        await asyncio.to_thread(self.store.open_session, header.session_id, tenant)  # another tenant's: NotFound
        return header

    async def _import_within_limits(self, header: service_pb2.ImportCheckpointHeader, tenant: str, base_model: str,
                                    trainer: TrainerHandle, files: dict[str, bytes]) -> service_pb2.ImportCheckpointResponse:
        # the limits hold exactly against this tenant's other creations, and storage against its saves too
        async with self._creating_runs[tenant], self.admission.quotas.storage_lock(tenant):
            limits = await self.admission.quotas.limits(tenant)
            if limits.max_training_runs:
                check_hard_limit("max_training_runs", limits.max_training_runs,
                                 await asyncio.to_thread(self.store.open_training_runs, tenant))
            used = 0
            if limits.max_storage_bytes:  # the files are written as uploaded: their bytes exactly
                used = await asyncio.to_thread(self.store.storage_bytes, tenant)
                check_hard_limit("max_storage_bytes", limits.max_storage_bytes, used, adding=sum(map(len, files.values())))
            return await self._import(header, tenant, base_model, trainer, files, (limits.max_storage_bytes, used))

    async def _import(self, header: service_pb2.ImportCheckpointHeader, tenant: str, base_model: str, trainer: TrainerHandle,
                      files: dict[str, bytes], storage: tuple[int, int]) -> service_pb2.ImportCheckpointResponse:
        """``storage``: the tenant's max_storage_bytes (0: none) and its use before this import."""
        number = await asyncio.to_thread(self.store.reserve_run, header.session_id)
        run_id = number.run_id
        paths = [CheckpointPath(run_id, types_pb2.CHECKPOINT_KIND_SAMPLER, header.name)]
        if header.save_state:
            paths.append(CheckpointPath(run_id, types_pb2.CHECKPOINT_KIND_TRAINING, header.name))
        # the loaded weights cannot be made again: trainer recovery restores the run from this snapshot
        snapshot = snapshot_key(run_id, 0) if self.admission.settings.recovery != "off" else None
        metadata, adapter_made = dict(header.user_metadata), False
        try:
            imported = await trainer.import_adapter(paths[0].key, files)
            cfg = imported.lora_config
            adapter_made = True  # from here on, whatever the call's outcome
            # cfg.expert_rank: the file's experts' rank (its rank_pattern), asked for exactly; the answer is the rank in effect
            created = await trainer.call("CreateAdapter", trainer_pb2.CreateAdapterRequest(training_run_id=run_id, lora_config=cfg))
            await trainer.call("LoadAdapter", trainer_pb2.LoadAdapterRequest(training_run_id=run_id, checkpoint_key=paths[0].key))
            sizes = [imported.size_bytes]
            if header.save_state and storage[0]:
                # the training checkpoint is in the trainer's own format: measured before it is written;
                # if both would not fit, refused and the import undone
                measured = await trainer.call("SaveAdapter", trainer_pb2.SaveAdapterRequest(
                    training_run_id=run_id, checkpoint_key=paths[1].key, include_optimizer=True, measure_only=True))
                check_hard_limit("max_storage_bytes", *storage, adding=sizes[0] + measured.size_bytes)
            if header.save_state:
                # with the (fresh, empty) optimizer state: a training checkpoint always has one, so
                # loading it with_optimizer works as for any other (the optimizer starts afresh)
                saved = await trainer.call("SaveAdapter", trainer_pb2.SaveAdapterRequest(
                    training_run_id=run_id, checkpoint_key=paths[1].key, include_optimizer=True))
                sizes.append(saved.size_bytes)
            if snapshot is not None:
                await trainer.snapshot(run_id, snapshot)
            row = new_run_row(run_id, header.session_id, base_model, cfg, metadata, trainer.address, snapshot,
                              created_expert_rank(created))
            checkpoints = [m.Checkpoint(training_run_id=run_id, kind=KIND_NAMES[path.kind], name=path.name, path=str(path),
                                        size_bytes=size, user_metadata=metadata) for path, size in zip(paths, sizes)]
            await asyncio.to_thread(self.store.add_imported_run, row, checkpoints, tenant, caller_actor())
        except BaseException:
            keys = [path.key for path in paths] + ([snapshot] if snapshot else [])
            if await undo_creation(trainer, run_id if adapter_made else None, keys):
                await give_back_run(self.store, header.session_id, number)
            raise
        self.backends.remember_placement(run_id, trainer.address)
        run = self.runs.add(row, tenant)
        log.info("imported %s for %s (%d bytes, rank %d)", paths[0], tenant, sizes[0], cfg.rank)
        response = service_pb2.ImportCheckpointResponse(checkpoint=checkpoint_message(checkpoints[0], row),
                                                        training_run=self._run_info(run))
        if header.save_state:
            response.state_checkpoint.CopyFrom(checkpoint_message(checkpoints[1], row))
        return response
