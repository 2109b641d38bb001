"""Checks on an outside peft LoRA adapter (adapter_config.json + adapter_model.safetensors) before it
becomes a checkpoint: the same rules as our own files, stated up front so a bad upload is refused
(InvalidArgument) before anything is written.

What is accepted is what a Temper run could have saved: plain LoRA on this trainer's base model,
targets one of the module groups a run trains (attention, MLP, unembedding, or a union of them; on a
mixture-of-experts model the MLP group holds the routed experts as peft ``target_parameters``), the
tensor names and shapes ``LoraModel.add`` would make, float weights that are all finite. Such an
adapter can be sampled and loaded into a run (``load_state``) like one trained here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from temper.common.errors import InvalidArgument, bounded, shown
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.trainer.adapters import lora_targets

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 64 << 10
MAX_RANK = 512
HEADER_SLACK_BYTES = 1 << 20  # the safetensors header (names, shapes) on top of the tensor bytes
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# peft options that change what the weights mean: refused unless at their plain-LoRA value (rank_pattern is
# read by AdapterSpec.from_peft_config: it may only give the routed experts their own rank)
_PLAIN = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
          "alpha_pattern": {}, "layers_to_transform": None, "layer_replication": None}


def max_weights_bytes(lora: LoraModel, spec: AdapterSpec) -> int:
    """The largest adapter_model.safetensors an adapter of ``spec`` can be (float32) on this model."""
    return sum(a * b for a, b in lora.param_shapes(spec).values()) * 4 + HEADER_SLACK_BYTES


def max_upload_bytes(lora: LoraModel) -> int:
    """The largest upload (both files) an acceptable adapter can be on this model: rank MAX_RANK on every layer."""
    widest = AdapterSpec(rank=MAX_RANK, alpha=1.0, targets=tuple(sorted(lora.available_targets())), expert_rank=MAX_RANK)
    return max_weights_bytes(lora, widest) + MAX_CONFIG_BYTES


@dataclass(frozen=True)
class ImportedLora:
    """The LoRA config (LoraConfig's fields) of a run the imported adapter fits; a plain value because
    the engine imports no protobuf (the servicer converts)."""
    rank: int
    alpha: float
    dropout: float
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    expert_rank: int = 0


def read_config(data: bytes, base_model: str, available: set[str], group_targets=lora_targets
                ) -> tuple[AdapterSpec, ImportedLora]:
    """The adapter's spec and the LoRA config of a run with the same adapter layout. ``group_targets(attn,
    mlp, unembed)``: the targets of each group on this model (``LoraModel.group_targets``)."""
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidArgument(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    # Messages name the config's keys, never echo its values (up to MAX_CONFIG_BYTES of the caller's).
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{CONFIG_FILE} is not JSON: {exc}") from None  # says where, echoes nothing
    except RecursionError:
        raise InvalidArgument(f"{CONFIG_FILE} is nested too deeply") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"only LoRA adapters can be imported, not peft_type {_shown(config.get('peft_type'))}")
    if config.get("base_model_name_or_path") != base_model:
        named = _shown(config.get("base_model_name_or_path"))
        raise InvalidArgument(f"the adapter is for base model {named}, not {base_model!r}")
    for key, plain in _PLAIN.items():
        if config.get(key, plain) not in (plain, None, {}, [], False):
            raise InvalidArgument(f"adapter_config {key} is not supported (plain LoRA only: {key}={plain!r})")
    try:
        spec = AdapterSpec.from_peft_config(config)
    except ValueError as exc:  # AdapterSpec's own messages name the field and echo no value of the caller's
        raise InvalidArgument(f"bad {CONFIG_FILE}: {bounded(str(exc), 300)}") from None
    except (KeyError, TypeError) as exc:
        raise InvalidArgument(f"bad {CONFIG_FILE}: {type(exc).__name__} reading its LoRA fields (r, lora_alpha, "
                              f"lora_dropout, target_modules, target_parameters, rank_pattern)") from None
    if not 1 <= spec.rank <= MAX_RANK:
        raise InvalidArgument(f"LoRA rank must be in [1, {MAX_RANK}], got {spec.rank}")
    if not math.isfinite(spec.alpha) or spec.alpha <= 0 or not 0 <= spec.dropout < 1:
        raise InvalidArgument("lora_alpha must be a finite number > 0 and lora_dropout in [0, 1)")
    if spec.expert_targets and not 1 <= spec.expert_rank <= spec.rank:
        raise InvalidArgument(f"rank_pattern: the routed experts' rank must be in [1, r={spec.rank}], got {spec.expert_rank}")
    for attn, mlp, unembed in product((False, True), repeat=3):
        if spec.targets and spec.targets == group_targets(attn, mlp, unembed) and set(spec.targets) <= available:
            return spec, ImportedLora(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, train_attn=attn,
                                      train_mlp=mlp, train_unembed=unembed, expert_rank=spec.expert_rank)
    raise InvalidArgument(f"target_modules/target_parameters {_shown(list(spec.targets))} must be whole groups Temper "
                          f"trains: attention {list(group_targets(attn=True))}, MLP {list(group_targets(mlp=True))}, "
                          f"unembedding ['lm_head'], or unions of them, of layers this model has")


def _shown(value, limit: int = 160) -> str:
    """A value of the caller's config or file for a message, cut short."""
    return shown(value, limit) if isinstance(value, str) else bounded(repr(value), limit)


def check_adapter_folder(folder: Path, lora: LoraModel) -> ImportedLora:
    """Check an uploaded adapter folder against ``lora``'s base model; the LoRA config of a run it fits.
    Reads, never writes."""
    names = sorted(p.name for p in folder.iterdir())
    if names != sorted([CONFIG_FILE, WEIGHTS_FILE]):
        raise InvalidArgument(f"an adapter is exactly {CONFIG_FILE} and {WEIGHTS_FILE}, got {_shown(names)}")
    try:
        lora.group_targets()
    except ValueError as exc:  # a model of no known family takes no adapter
        raise InvalidArgument(str(exc)) from None
    spec, config = read_config((folder / CONFIG_FILE).read_bytes(), lora.base_model_name, lora.available_targets(),
                               lora.group_targets)
    try:
        lora.resolve(spec)
    except ValueError as exc:
        raise InvalidArgument(f"bad {CONFIG_FILE}: {exc}") from None
    weights_file = folder / WEIGHTS_FILE
    if weights_file.stat().st_size > max_weights_bytes(lora, spec):
        raise InvalidArgument(f"{WEIGHTS_FILE} is larger than a rank-{spec.rank} adapter of this model can be")
    try:
        weights = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidArgument(f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None
    expected = lora.param_shapes(spec)
    if set(weights) != set(expected):
        extra, missing = sorted(set(weights) - set(expected)), sorted(set(expected) - set(weights))
        raise InvalidArgument(f"adapter tensors do not match a rank-{spec.rank} LoRA of {_shown(list(spec.targets))} on this "
                              f"model: {len(extra)} unexpected {_shown(extra[:3])}, {len(missing)} missing {_shown(missing[:3])}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != expected[name]:
            raise InvalidArgument(f"{name}: shape {_shown(tuple(tensor.shape))}, expected {expected[name]}"
                                  f"{_experts_hint(name, tuple(tensor.shape), expected[name], spec.expert_rank)}")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise InvalidArgument(f"{name}: dtype {tensor.dtype}; LoRA weights are float32, bfloat16 or float16")
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidArgument(f"{name} holds NaN or infinite values")
    return config


def _experts_hint(name: str, shape: tuple, expected: tuple, expert_rank: int) -> str:
    """For a routed-experts tensor, how many experts of rank ``expert_rank`` the file holds against the model's."""
    if ".experts." not in name or expert_rank <= 0 or len(shape) != 2:
        return ""
    width, wanted = (shape[0], expected[0]) if ".lora_A." in name else (shape[1], expected[1])
    if width % expert_rank or width == wanted:
        return ""
    return f" ({width // expert_rank} experts of rank {expert_rank}; the model has {wanted // expert_rank} routed experts)"
