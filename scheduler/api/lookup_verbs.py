"""Lookups of the caller's objects (ListTrainingRuns, GetSamplingClient, GetRequestResult), the checks shared by
run creation, and what a run created from a checkpoint starts from (``CheckpointSource``).

Every lookup sees only the caller's tenant: another tenant's id answers the same NOT_FOUND as a
missing one. Nothing here changes state except ``CheckpointSource.load_into`` on a run being made.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Mapping

from temper.common.checkpoints import CheckpointPath
from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound, TemperError, shown
from temper.scheduler.planning.admission import stored_answer
from temper.scheduler.tenancy.auth import caller
from temper.scheduler.workers.backends import TrainerHandle
from temper.scheduler.db import models as m
from temper.scheduler.db.views import run_message
from temper.services.lora.expert_rank import ExpertRankError, check_range, resolve_expert_rank
from temper.v1 import sampler_pb2, service_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)
MAX_LORA_RANK = 1024
DEFAULT_RUNS_PAGE, MAX_RUNS_PAGE = 20, 1000
MAX_METADATA_ENTRIES, MAX_METADATA_CHARS = 64, 4096


def check_lora(cfg: types_pb2.LoraConfig) -> None:
    if not 0 < cfg.rank <= MAX_LORA_RANK:
        raise InvalidArgument(f"lora rank must be in [1, {MAX_LORA_RANK}], got {cfg.rank}")
    if not (cfg.train_attn or cfg.train_mlp or cfg.train_unembed):
        raise InvalidArgument("the LoRA config trains nothing: set train_attn, train_mlp or train_unembed")
    if not math.isfinite(cfg.alpha) or cfg.alpha < 0 or not 0 <= cfg.dropout < 1:
        raise InvalidArgument("lora alpha must be a finite number >= 0 and dropout in [0, 1)")
    try:
        check_range(cfg.rank, cfg.expert_rank, prefix="lora_config.")
    except ExpertRankError as exc:
        raise InvalidArgument(str(exc)) from None


def check_lora_for_model(cfg: types_pb2.LoraConfig, info: trainer_pb2.ModelInfo) -> None:
    """What the model's trainer would refuse about ``cfg``'s routed-expert LoRA, refused here first so that
    nothing (not even a run number) is spent on it: the rule the trainer applies (LoraModel.resolve), read
    from the same place (services/lora/expert_rank.py)."""
    try:
        resolve_expert_rank(rank=cfg.rank, expert_rank=cfg.expert_rank, dropout=cfg.dropout,
                            has_experts=bool(info.num_experts), adapts_experts=cfg.train_mlp,
                            top_k=info.num_experts_per_tok, model=f"{shown(info.base_model, 80)} ({info.family or 'dense'})",
                            family=info.family, prefix="lora_config.")
    except ExpertRankError as exc:
        raise InvalidArgument(str(exc)) from None


def check_deterministic(info: trainer_pb2.ModelInfo | sampler_pb2.SamplerModelInfo, base_model: str) -> None:
    """Deterministic mode asked of a trainer or sampler (its model info) that cannot provide it: refused
    before anything is made, naming what is missing (docs/deterministic.md); never a silent best effort."""
    if missing := info.deterministic_unsupported:
        raise FailedPrecondition(f"deterministic mode for {shown(base_model, 80)}: {missing}")


def check_user_metadata(metadata: Mapping[str, str]) -> None:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"user_metadata has {len(metadata)} entries, at most {MAX_METADATA_ENTRIES}")
    if any(len(k) + len(v) > MAX_METADATA_CHARS for k, v in metadata.items()):
        raise InvalidArgument(f"a user_metadata entry is longer than {MAX_METADATA_CHARS} characters")


@dataclass
class CheckpointSource:
    """A readable checkpoint a new run starts from, the run that saved it, and the trainer holding its files."""

    path: CheckpointPath
    run: m.TrainingRun
    trainer: TrainerHandle
    with_optimizer: bool

    async def load_into(self, run_id: str) -> None:
        """Load the checkpoint into the new run's adapter; if that fails, the adapter is dropped again."""
        try:
            await self.trainer.call("LoadAdapter", trainer_pb2.LoadAdapterRequest(
                training_run_id=run_id, checkpoint_key=self.path.key, with_optimizer=self.with_optimizer))
        except BaseException:
            try:
                await self.trainer.call("DropAdapter", trainer_pb2.DropAdapterRequest(training_run_id=run_id))
            except TemperError as exc:
                log.warning("could not drop the adapter of %s after its load failed: %s", run_id, exc.message)
            raise


class LookupVerbs:
    """Mixed into TemperServicer (store, backends, runs, admission come from it)."""

    async def ListTrainingRuns(self, request, context):
        limit = request.limit or DEFAULT_RUNS_PAGE
        if not 0 < limit <= MAX_RUNS_PAGE or request.offset < 0:
            raise InvalidArgument(f"limit must be in [0, {MAX_RUNS_PAGE}] (0: {DEFAULT_RUNS_PAGE}) and offset >= 0")
        await self.backends.wait_ready()
        tenant = caller()
        if request.project_id:  # issue 33: NotFound for a project not the caller's
            await asyncio.to_thread(self.store.check_projects, [request.project_id], tenant)
        rows, total = await asyncio.to_thread(self.store.tenant_runs, tenant, limit, request.offset, request.project_id)
        response = service_pb2.ListTrainingRunsResponse(total_count=total)
        for row in rows:
            known = self.runs.known(row.id)
            next_seq = self.admission.next_seq_id(known) if known is not None else row.next_seq_id
            response.training_runs.append(run_message(row, tenant, next_seq, self._model_info(row.base_model)))
        return response

    def _model_info(self, base_model: str) -> trainer_pb2.ModelInfo | None:
        try:
            return self.backends.trainer_for(base_model, "").info
        except TemperError:  # no trainer serves that model now: listed without tokenizer and sizes
            return None

    async def GetRequestResult(self, request, context):
        """A sequenced request's answer from its row (the row is marked done before its answer goes out)."""
        if request.seq_id < 1:
            raise InvalidArgument(f"seq_id must be >= 1, got {request.seq_id}")
        run = await self.runs.get(request.training_run_id, caller())
        record = await asyncio.to_thread(self.store.get_request, run.run_id, request.seq_id)
        if record is None:
            raise NotFound(f"seq_id {request.seq_id} of {run.run_id} was not received")
        answer = stored_answer(record)  # FailedPrecondition: it failed, or its answer is no longer held
        result = service_pb2.RequestResult(kind=record.kind, done=answer is not None)
        if answer is not None:
            getattr(result, {"forward": "forward_backward"}.get(record.kind, record.kind)).CopyFrom(answer)
        return result

    async def GetSamplingClient(self, request, context):
        row, _, _ = await asyncio.to_thread(self.store.get_sampling_client, request.sampler_id, caller())
        info = await self._client_info(row)  # an in-flight client: its run's target now (inflight_verbs.py)
        try:
            model = self.backends.sampler_info(row.base_model)
            info.tokenizer_id, info.vocab_size = model.tokenizer_id, model.vocab_size
        except TemperError:  # no sampler of that model now
            pass
        return info
