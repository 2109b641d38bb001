"""Database rows as the public API's messages: a training run (TrainingRunInfo) and a checkpoint
(Checkpoint, with its run's base model and LoRA shape). Pure functions of rows and worker info."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from temper.common.checkpoints import KIND_DIRS
from temper.scheduler.db import models as m
from temper.v1 import service_pb2, trainer_pb2, types_pb2

KIND_NAMES = {types_pb2.CHECKPOINT_KIND_SAMPLER: "sampler", types_pb2.CHECKPOINT_KIND_TRAINING: "training",
              types_pb2.CHECKPOINT_KIND_EXTERNAL: "external"}


def unix_ms(value: datetime | None) -> int:
    if value is None:
        return 0
    if value.tzinfo is None:  # SQLite hands back naive UTC
        value = value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1000)


def lora_of(run: m.TrainingRun) -> types_pb2.LoraConfig:
    """The run's LoRA config; expert_rank is the routed experts' rank in effect (0: no expert LoRA), so a
    run created from it (from_path) has the same adapter shape."""
    lora = types_pb2.LoraConfig(rank=run.lora_rank, alpha=run.lora_alpha, train_attn=run.train_attn, train_mlp=run.train_mlp,
                                train_unembed=run.train_unembed, dropout=run.lora_dropout, expert_rank=run.lora_expert_rank or 0)
    if run.seed is not None:
        lora.seed = run.seed
    return lora


def run_message(run: m.TrainingRun, owner: str, next_seq_id: int,
                model: trainer_pb2.ModelInfo | None) -> service_pb2.TrainingRunInfo:
    """``model``: its trainer's model info (tokenizer, vocabulary, context); None leaves those unset."""
    info = service_pb2.TrainingRunInfo(
        training_run_id=run.id, base_model=run.base_model, lora_config=lora_of(run), next_seq_id=next_seq_id,
        user_metadata={str(k): str(v) for k, v in (run.user_metadata or {}).items()}, owner=owner,
        created_unix_ms=unix_ms(run.created_at), last_request_unix_ms=unix_ms(run.last_request_at or run.created_at),
        deterministic=bool(run.deterministic),
        inflight=types_pb2.WeightsVersion(path=run.inflight_path or "", version=run.inflight_version or 0))
    if model is not None:
        info.tokenizer_id, info.vocab_size, info.max_context_length = model.tokenizer_id, model.vocab_size, model.max_context_length
        info.family, info.num_experts, info.num_experts_per_tok = model.family, model.num_experts, model.num_experts_per_tok
    return info


def checkpoint_message(row: m.Checkpoint, run: m.TrainingRun | None = None,
                       idle_expiry: timedelta | None = None) -> types_pb2.Checkpoint:
    """``run``: the run that saved it (fills base_model and lora_config). ``idle_expiry``: how long an
    unused temporary (ephemeral) checkpoint is kept; its expires_unix_ms is its last use plus that."""
    kind = {v: k for k, v in KIND_NAMES.items()}[row.kind]
    msg = types_pb2.Checkpoint(
        checkpoint_id=f"{KIND_DIRS[kind]}/{row.name}", kind=kind, path=row.path, training_run_id=row.training_run_id,
        size_bytes=row.size_bytes, created_unix_ms=unix_ms(row.created_at), published=bool(row.published),
        expires_unix_ms=unix_ms(row.expires_at), user_metadata={str(k): str(v) for k, v in (row.user_metadata or {}).items()},
    )
    if row.ephemeral:
        msg.temporary = True
        if idle_expiry is not None and not row.expires_at:
            msg.expires_unix_ms = unix_ms((row.last_used_at or row.created_at) + idle_expiry)
    if run is not None:
        msg.base_model = run.base_model
        msg.lora_config.CopyFrom(lora_of(run))
    return msg
