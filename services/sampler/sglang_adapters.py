"""Which pushed peft adapters the SGLang backend can serve as trained (``check_servable``), and reading
one as ``Engine.load_lora_adapter_from_tensors`` takes it (``read_adapter``). docs/sglang_moe_lora.md
says what the pinned SGLang serves per family."""

from __future__ import annotations

import json
import re
from pathlib import Path

from temper.common.errors import InvalidArgument

SGLANG_VERSION = "0.5.23"  # keep equal to the pin of the `sglang` extra in pyproject.toml


def read_adapter(folder: Path) -> tuple[dict, dict]:
    """(adapter_config.json as a dict, {peft tensor name: CPU tensor}): the arguments of
    ``Engine.load_lora_adapter_from_tensors``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"not a peft LoRA adapter: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA" or not isinstance(config.get("r"), int):
        raise InvalidArgument("not a peft LoRA adapter: adapter_config.json needs peft_type LORA and an integer r")
    return config, tensors


# peft's ParamWrapper on the fused 3-D routed-expert weights: the target_parameters entries, and tensor
# keys that name no module (not shared_experts, a plain module)
_ROUTED_PARAM = re.compile(r"(?:^|\.)experts\.")
_PEFT_EXPERT_KEY = re.compile(r"\.experts\.(?:base_layer\.)*lora_[AB]\.")
# Qwen3.5's gated-delta-net input projections (transformers' names), which SGLang 0.5.23 cannot adapt
_LINEAR_ATTN_INPUT = re.compile(r"\.linear_attn\.(in_proj_(?:qkv|z|b|a))\.")


def check_servable(config: dict, tensor_names, *, shared_experts_fused: bool) -> None:
    """Refuse (INVALID_ARGUMENT, naming the piece) an adapter SGLang 0.5.23 would load but not serve
    as trained. Never drop part of an adapter: a sampler that cannot serve all of it serves none of it.

    Why, as read in the 0.5.23 wheel (details and line references: docs/sglang_moe_lora.md):
    ``srt/lora/lora_config.py::LoRAConfig`` reads only target_modules, r, lora_alpha and use_dora, so
    - peft ``target_parameters`` on the fused routed-expert parameters (tensors
      ``...mlp.experts[.base_layer].lora_A.weight``) load "successfully", name no module SGLang knows,
      and the first batch that uses the adapter raises in the scheduler
      (``LoRAMemoryPool.load_lora_weight_to_buffer``), which takes the engine (this process) down.
      ``target_parameters`` on a linear's 2-D weight (``gate_proj.weight``: how Temper names the dense
      MLPs and shared experts of an MoE model) are plain module LoRA, which SGLang serves;
    - ``rank_pattern`` / ``alpha_pattern`` are ignored: every module is read at rank ``r`` (another
      rank fails like the above) and scaled ``lora_alpha / r`` (another alpha: silently wrong);
    - ``kv_a_proj_with_mqa`` is served only fused with ``q_a_proj`` (``fused_qkv_a_proj_with_mqa``):
      alone its tensors match no module, and fail like the above;
    - a shared expert fused into the routed experts (DeepSeek-V3 unless ``disable_shared_experts_fusion``)
      has no ``shared_experts`` module, so its LoRA would be silently skipped;
    - a vision-language model's tower and merger (``model.visual.*``) take no LoRA (``sglang_images.py``):
      their tensors would be skipped silently;
    - Qwen3.5's linear-attention input projections: ``srt/models/qwen3_5.py`` fuses them into
      ``in_proj_qkvz`` and ``in_proj_ba``; ``supported_lora_modules`` lists ``in_proj_qkvz`` (and
      ``out_proj``) but not ``in_proj_ba``, and ``srt/lora/lora.py::_normalize_in_proj_qkvz`` stacks only
      split ``in_proj_q/k/v/z`` tensors, not transformers' ``in_proj_qkv`` + ``in_proj_z``: the adapter's
      targets are not in the LoRA pool (``LoRAMemoryPool.can_support``) and loading fails unnamed.
    """
    def refuse(piece: str, fix: str = "use TEMPER_SAMPLER_BACKEND=torch for this adapter") -> InvalidArgument:
        return InvalidArgument(f"SGLang {SGLANG_VERSION} cannot serve {piece}; {fix}")

    names = sorted(tensor_names)
    params = config.get("target_parameters") or []
    params = [params] if isinstance(params, str) else list(params)
    routed = [p for p in params if _ROUTED_PARAM.search(p)]
    fused = routed or [p for p in params if not p.endswith(".weight")]  # "gate_proj.weight": a plain linear
    if fused:
        what = "routed experts" if routed else "fused parameters"
        raise refuse(f"LoRA on {what} (target_parameters {', '.join(fused)})")
    expert_keys = [n for n in names if _PEFT_EXPERT_KEY.search(n)]
    if expert_keys:
        raise refuse(f"LoRA on routed experts (peft expert tensors such as {expert_keys[0]})")
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    for field_name, plain in (("rank_pattern", r), ("alpha_pattern", alpha)):
        odd = {k: v for k, v in (config.get(field_name) or {}).items() if v != plain}
        if odd:
            raise refuse(f"per-module ranks or scales ({field_name} {odd}; it serves every module at r={r}, "
                         f"lora_alpha={alpha})")
    if any(".kv_a_proj_with_mqa." in n for n in names) and not any(".q_a_proj." in n for n in names):
        raise refuse("LoRA on kv_a_proj_with_mqa without q_a_proj (it serves the two only as one fused "
                     "projection, fused_qkv_a_proj_with_mqa)")
    tower = [n for n in names if ".visual." in n]
    if tower:
        raise refuse(f"LoRA on the vision tower or merger (tensors such as {tower[0]}; its Qwen3-VL models adapt the "
                     f"language model only: should_apply_lora in srt/models/qwen3_vl.py)")
    linear_attn = sorted({m.group(1) for n in names if (m := _LINEAR_ATTN_INPUT.search(n))})
    if linear_attn:
        raise refuse(f"LoRA on Qwen3.5's linear-attention input projections ({', '.join(linear_attn)}; it fuses them "
                     f"into in_proj_qkvz and in_proj_ba, takes no LoRA on in_proj_ba and does not stack transformers' "
                     f"in_proj_qkv + in_proj_z: srt/models/qwen3_5.py, srt/lora/lora.py)")
    if shared_experts_fused and any("shared_experts." in n for n in names):
        raise refuse("LoRA on shared experts fused into the routed experts (no shared_experts module is left)",
                     "drop disable_shared_experts_fusion=false from TEMPER_SAMPLER_SGLANG_ENGINE_ARGS (Temper "
                     "starts SGLang with it true), or use TEMPER_SAMPLER_BACKEND=torch")
