"""The trainer's one protobuf <-> domain boundary (temper.v1 messages <-> engine objects).

Decoding is where wire payloads are checked, once per process (``common.validation``: dtypes,
shapes, token ranges, loss inputs and config, Adam parameters); the engine then works on the
decoded, checked domain objects only.
"""

from __future__ import annotations

import math

from typing import Callable, Iterable, TypeVar

from temper.common.checkpoints import WEIGHT_FILES
from temper.common.codec import encode_array
from temper.common.errors import InvalidArgument, TemperError, status_number
from temper.common.defaults import adam_with_defaults
from temper.common.validation import validate_adam, validate_forward_backward
from temper.services.lora.expert_rank import ExpertRankError, check_range
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models import families
from temper.services.models.images import DEFAULT_LIMITS, ImageLimits, VisionProcessor
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.checkpoints import FilePiece
from temper.services.trainer.engine import AdamParams, ForwardBackwardItem, ForwardBackwardResult, OptimStepItem, Refused
from temper.services.trainer.imports import ImportedLora
from temper.v1 import trainer_pb2, types_pb2


def adapter_from_pb(cfg: types_pb2.LoraConfig, default_alpha: float, lora: LoraModel | None = None
                    ) -> tuple[AdapterSpec, int | None]:
    """The adapter's spec and its initialisation seed (None: random). With ``lora``, the groups name that
    model's layers (its family's attention, dense and expert MLP); without, a Llama-shaped model's."""
    if cfg.rank <= 0:
        raise InvalidArgument(f"LoRA rank must be positive, got {cfg.rank}")
    if not math.isfinite(cfg.alpha) or cfg.alpha < 0:
        raise InvalidArgument(f"LoRA alpha must be a finite number >= 0, got {cfg.alpha}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise InvalidArgument(f"LoRA dropout must be in [0, 1), got {cfg.dropout}")
    try:
        check_range(cfg.rank, cfg.expert_rank, prefix="LoRA ")
    except ExpertRankError as exc:
        raise InvalidArgument(str(exc)) from None
    vision = cfg.HasField("train_vision") and cfg.train_vision
    if vision and lora is None:
        raise InvalidArgument("train_vision needs a vision-language base model")
    try:
        targets = (lora.group_targets(cfg.train_attn, cfg.train_mlp, cfg.train_unembed, vision) if lora is not None
                   else lora_targets(cfg.train_attn, cfg.train_mlp, cfg.train_unembed))
    except ValueError as exc:  # a model of no known family; train_vision on a text-only model
        raise InvalidArgument(str(exc)) from None
    if not targets:
        raise InvalidArgument("LoRA config trains nothing: enable train_attn, train_mlp, train_unembed or train_vision")
    spec = AdapterSpec(rank=cfg.rank, alpha=cfg.alpha or default_alpha, targets=targets, dropout=cfg.dropout,
                       expert_rank=cfg.expert_rank)
    return spec, (cfg.seed if cfg.HasField("seed") else None)


def imported_lora_to_pb(lora: ImportedLora) -> types_pb2.LoraConfig:
    """The LoRA config of a run an imported adapter loads into (no seed: its weights come from the file)."""
    return types_pb2.LoraConfig(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, train_attn=lora.train_attn,
                                train_mlp=lora.train_mlp, train_unembed=lora.train_unembed, expert_rank=lora.expert_rank)


def forward_backward_from_pb(item: trainer_pb2.ForwardBackwardItem, vocab_size: int, max_length: int | None = None,
                             vision: VisionProcessor | None = None, limits: ImageLimits = DEFAULT_LIMITS,
                             model: str = "the base model") -> ForwardBackwardItem:
    """``vision``: the base model's processor (LoadedModel.vision; None: text only, an image is refused),
    which expands each image into its image tokens and checks it against ``limits``."""
    data, config = validate_forward_backward(item.data, item.loss_fn, item.loss_fn_config, vocab_size, max_length,
                                             vision=vision, limits=limits, model=model)
    return ForwardBackwardItem(run_id=item.training_run_id, data=data, loss_fn=item.loss_fn, loss_config=config,
                               forward_only=item.forward_only, seq_id=item.seq_id, deterministic=item.deterministic)


def adam_from_pb(params: types_pb2.AdamParams) -> AdamParams:
    params = adam_with_defaults(params)  # a raw client's unset fields: Tinker's defaults
    validate_adam(params)
    return AdamParams(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2, eps=params.eps,
                      weight_decay=params.weight_decay, grad_clip_norm=params.grad_clip_norm)


def optim_step_from_pb(item: trainer_pb2.OptimStepItem) -> OptimStepItem:
    return OptimStepItem(run_id=item.training_run_id, adam=adam_from_pb(item.adam_params), seq_id=item.seq_id)


Item = TypeVar("Item")


def cycle_from_pb(request: trainer_pb2.CycleRequest, vocab_size: int, max_length: int | None = None,
                  vision: VisionProcessor | None = None, limits: ImageLimits = DEFAULT_LIMITS, model: str = "the base model",
                  ) -> tuple[list[ForwardBackwardItem | Refused], list[OptimStepItem | Refused]]:
    """Every item of the cycle decoded and checked, in order; an item that fails its check becomes a
    ``Refused`` carrying the error (the engine refuses that item's run, the others go on)."""
    return ([_decoded(forward_backward_from_pb, item, vocab_size, max_length, vision, limits, model)
             for item in request.forward_backward],
            [_decoded(optim_step_from_pb, item) for item in request.optim_step])


def _decoded(decode: Callable[..., Item], item, *args) -> Item | Refused:
    try:
        return decode(item, *args)
    except TemperError as exc:
        return Refused(item.training_run_id, exc, item.seq_id)


def forward_backward_to_pb(result: ForwardBackwardResult, out: types_pb2.ForwardBackwardOutput) -> None:
    out.loss_fn_output_type = "ArrayRecord"
    out.metrics.update(result.metrics)
    for logprobs, loss in zip(result.logprobs, result.elementwise_loss):
        out.loss_fn_outputs.add(
            fields={"logprobs": encode_array(logprobs, "float32"), "elementwise_loss": encode_array(loss, "float32")}
        )


def cycle_to_pb(results: list[ForwardBackwardResult | TemperError],
                steps: list[dict[str, float] | TemperError]) -> trainer_pb2.CycleResponse:
    """Each item's answer and status, in order; a failed item has an empty answer and its error's status."""
    response = trainer_pb2.CycleResponse()
    for result in results:
        out = response.forward_backward.add()
        if not isinstance(result, TemperError):
            forward_backward_to_pb(result, out)
        response.forward_backward_status.append(_status(result))
    for metrics in steps:
        out = response.optim_step.add()
        if not isinstance(metrics, TemperError):
            out.metrics.update(metrics)
        response.optim_step_status.append(_status(metrics))
    return response


def _status(outcome) -> trainer_pb2.ItemStatus:
    if isinstance(outcome, TemperError):
        return trainer_pb2.ItemStatus(code=status_number(outcome), message=outcome.message)
    return trainer_pb2.ItemStatus()


def checkpoint_files(request: trainer_pb2.ReadCheckpointRequest) -> tuple[str, tuple[str, ...] | None]:
    """(checkpoint key, the file names to send or None for all)."""
    if request.relative_path:
        if "/" in request.relative_path or "\\" in request.relative_path or request.relative_path in (".", ".."):
            raise InvalidArgument(f"relative_path {request.relative_path!r} must name one file of the checkpoint's folder")
        return request.checkpoint_key, (request.relative_path,)
    return request.checkpoint_key, (WEIGHT_FILES if request.weights_only else None)


def file_chunks_to_pb(pieces: Iterable[FilePiece]) -> Iterable[types_pb2.FileChunk]:
    for piece in pieces:
        yield types_pb2.FileChunk(relative_path=piece.relative_path, offset=piece.offset, data=piece.data,
                                  total_size=piece.total_size)


def model_info_to_pb(loaded, device: str, dtype: str, incarnation: str = "", world_size: int = 1,
                     devices: list[str] | None = None, device_memory: list[int] | None = None,
                     deterministic_unsupported: str = "") -> trainer_pb2.ModelInfo:
    """``deterministic_unsupported``: why this trainer cannot run deterministic items ("" : it can;
    ``TrainerEngine.deterministic_unsupported``)."""
    try:
        family, moe = families.family_of(loaded.model.config).name, families.moe_shape(loaded.model.config)
    except families.UnknownFamily:  # the trainer runs; it refuses adapters, naming why (LoraModel.family_error)
        family, moe = "", None
    return trainer_pb2.ModelInfo(base_model=loaded.name, tokenizer_id=loaded.path, vocab_size=loaded.vocab_size,
                                 max_context_length=loaded.max_context_length, device=device, dtype=dtype,
                                 incarnation=incarnation, family=family, num_experts=moe.num_experts if moe else 0,
                                 num_experts_per_tok=moe.top_k if moe else 0, world_size=world_size,
                                 devices=devices or [device], device_memory_bytes=device_memory or [],
                                 deterministic_unsupported=deterministic_unsupported,
                                 vision=loaded.vision.info() if getattr(loaded, "vision", None) is not None else None)
