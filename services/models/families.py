"""The model families Temper trains, and what each one's adapters are made of.

A family names the transformers ``model_type``s it covers, the linear layers of its attention and of
its dense MLPs (LoRA wraps these ``nn.Linear``s), the config fields it cannot do without, and for a
mixture-of-experts family how its routed experts store their weights: transformers 5 keeps every
expert of a layer in two fused 3-D parameters (``gate_up_proj``, ``down_proj``), which LoRA adapts
per expert (``services/lora/experts.py``). A model of no known family, or one whose modules do not
look as its family says, is refused by name: Temper never quietly trains only part of what was asked.

Imports nothing heavy (torch only where a layout's activation runs), so tools that plan memory read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
# DeepSeek's multi-head latent attention: low-rank q (q_a/q_b; plain q_proj when q_lora_rank is None),
# one joint compressed kv projection and its up-projection
MLA_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# Qwen3.5's gated-delta-net linear attention (three of every four decoder layers): the fused q/k/v input
# projection, the output gate's z, the per-head beta (b) and decay (a) inputs, and the output projection
LINEAR_ATTN_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_LINEARS = ("lm_head",)
EXPERTS_PATH = "mlp.experts"  # where every MoE family here keeps its routed experts, below a decoder layer


def _chunked_glu(module, gate_up):
    """Qwen3-MoE and DeepSeek-V3: gate and up are the two halves of the fused projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _gpt_oss_glu(module, gate_up):
    """GPT-OSS: gate and up interleaved, clamped, ``(up + 1) * gate * sigmoid(alpha * gate)`` (its own method)."""
    return module._apply_gate(gate_up)


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's fused routed experts hold their weights.

    ``transposed``: parameters are (experts, in, out) and apply as ``x @ W[e]`` (GPT-OSS); otherwise
    (experts, out, in) as ``F.linear(x, W[e])``. ``glu(module, gate_up)``: the activation between the
    two projections, on the gate_up projection's output (LoRA's delta is added before it)."""

    class_names: tuple[str, ...]
    transposed: bool
    glu: Callable[[Any, Any], Any]
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    gate_up_bias: str | None = None
    down_bias: str | None = None


@dataclass(frozen=True)
class VisionLayout:
    """A vision-language family's multimodal details: the config fields holding the ids an image
    expands into (read from each model's config, never assumed), where its vision tower sits, and the
    short names of the tower's and merger's linear layers (LoRA targets only when a run names them:
    ``LoraConfig.train_vision``). Images are counted and turned into pixels by the model's own image
    processor (``services/models/images.py``)."""

    image_token_field: str = "image_token_id"
    start_token_field: str = "vision_start_token_id"
    end_token_field: str = "vision_end_token_id"
    tower: str = "model.visual"
    linears: tuple[str, ...] = ("qkv", "proj", "linear_fc1", "linear_fc2")


QWEN_VL = VisionLayout()


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    attention: tuple[str, ...]
    required: tuple[str, ...]                     # config fields the family cannot do without
    experts: ExpertLayout | None = None
    num_experts_field: str = ""                   # config field with the number of routed experts
    mlp: tuple[str, ...] = MLP_LINEARS            # dense MLP / shared-expert linears
    notes: str = ""
    vision: VisionLayout | None = None            # vision-language families: images in the model input

    @property
    def moe(self) -> bool:
        return self.experts is not None


_DENSE_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_MOE_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok")
_LINEAR_ATTN_REQUIRED = ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim")

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama", "mistral"), ATTN_LINEARS, _DENSE_REQUIRED, notes="SmolLM2, Llama 3"),
    Family("qwen3", ("qwen3", "qwen2"), ATTN_LINEARS, _DENSE_REQUIRED),
    Family("qwen3_moe", ("qwen3_moe",), ATTN_LINEARS, _MOE_REQUIRED + ("num_experts", "moe_intermediate_size"),
           ExpertLayout(("Qwen3MoeExperts",), transposed=False, glu=_chunked_glu), num_experts_field="num_experts",
           notes="Qwen3-30B-A3B, Qwen3-235B-A22B"),
    Family("gpt_oss", ("gpt_oss",), ATTN_LINEARS, _MOE_REQUIRED + ("num_local_experts", "intermediate_size"),
           ExpertLayout(("GptOssExperts",), transposed=True, glu=_gpt_oss_glu, gate_up_bias="gate_up_proj_bias",
                        down_bias="down_proj_bias"),
           num_experts_field="num_local_experts", notes="expert biases, attention sinks, alternating sliding-window layers"),
    Family("deepseek_v3", ("deepseek_v3",), MLA_LINEARS,
           _MOE_REQUIRED + ("n_routed_experts", "moe_intermediate_size", "kv_lora_rank", "qk_rope_head_dim",
                            "qk_nope_head_dim", "v_head_dim"),
           ExpertLayout(("DeepseekV3Experts",), transposed=False, glu=_chunked_glu), num_experts_field="n_routed_experts",
           notes="MLA attention, shared + routed experts, first layers dense"),
    # vision-language: the language model's config (text_config) decides the family, the wrapper's the vision
    Family("qwen3_vl", ("qwen3_vl_text",), ATTN_LINEARS, _DENSE_REQUIRED, vision=QWEN_VL,
           notes="Qwen3-VL: images through the vision tower, multimodal rotary positions"),
    Family("qwen3_vl_moe", ("qwen3_vl_moe_text",), ATTN_LINEARS,
           _MOE_REQUIRED + ("num_experts", "moe_intermediate_size"),
           ExpertLayout(("Qwen3VLMoeTextExperts",), transposed=False, glu=_chunked_glu), num_experts_field="num_experts",
           vision=QWEN_VL, notes="Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B"),
    # hybrid decoders: gated-delta-net linear-attention layers and gated full-attention layers, both adapted
    # as the attention group; a tower as Qwen3-VL's without deepstack
    Family("qwen3_5", ("qwen3_5_text",), ATTN_LINEARS + LINEAR_ATTN_LINEARS, _DENSE_REQUIRED + _LINEAR_ATTN_REQUIRED,
           vision=QWEN_VL, notes="Qwen3.5 (dense): linear attention in 3 of 4 layers"),
    Family("qwen3_5_moe", ("qwen3_5_moe_text",), ATTN_LINEARS + LINEAR_ATTN_LINEARS,
           _MOE_REQUIRED + ("num_experts", "moe_intermediate_size") + _LINEAR_ATTN_REQUIRED,
           ExpertLayout(("Qwen3_5MoeExperts",), transposed=False, glu=_chunked_glu), num_experts_field="num_experts",
           vision=QWEN_VL, notes="Qwen3.5-MoE: a gated shared expert beside the routed ones, linear attention"),
)


class UnknownFamily(ValueError):
    """The model's family or layout is not one Temper can adapt; the message names what is missing."""


def family_of(config) -> Family:
    """The family of a transformers config (its text config for multimodal wrappers)."""
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise UnknownFamily(f"model family {model_type!r} ({_architecture(config)}) is not one Temper trains; known "
                        f"model_types: {known}")


def check_config(config) -> Family:
    """The config's family, once every field it needs is present and consistent (UnknownFamily otherwise)."""
    family = family_of(config)
    text = getattr(config, "text_config", None) or config
    missing = [name for name in family.required if getattr(text, name, None) is None]
    if missing:
        raise UnknownFamily(f"{family.name} config lacks {missing}")
    if family.moe:
        experts, top_k = int(getattr(text, family.num_experts_field)), int(text.num_experts_per_tok)
        if experts < 1:
            raise UnknownFamily(f"{family.name} config: {family.num_experts_field}={experts} must be at least 1")
        if not 1 <= top_k <= experts:
            raise UnknownFamily(f"{family.name} config: num_experts_per_tok={top_k} must be in [1, "
                                f"{family.num_experts_field}={experts}]")
    return family


@dataclass(frozen=True)
class MoeShape:
    """What a config says about its routed experts (``moe_shape``)."""
    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_experts: int = 0
    dense_layers: int = 0        # decoder layers with a dense MLP instead of experts
    extra: dict = field(default_factory=dict)


def moe_shape(config) -> MoeShape | None:
    """The routed-expert shape of an MoE config; None for a dense one."""
    family = check_config(config)
    if not family.moe:
        return None
    text = getattr(config, "text_config", None) or config
    experts, top_k = int(getattr(text, family.num_experts_field)), int(text.num_experts_per_tok)
    layers = int(text.num_hidden_layers)
    if family.name == "gpt_oss":
        return MoeShape(experts, top_k, int(text.intermediate_size))
    if family.name == "deepseek_v3":
        return MoeShape(experts, top_k, int(text.moe_intermediate_size), int(getattr(text, "n_shared_experts", 0) or 0),
                        min(layers, int(getattr(text, "first_k_dense_replace", 0) or 0)))
    sparse_step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = {i for i in range(layers) if i in (getattr(text, "mlp_only_layers", None) or []) or (i + 1) % sparse_step}
    expert_intermediate = int(text.moe_intermediate_size)
    # Qwen3.5-MoE: one shared expert per layer, counted in routed-expert widths (the real models': 1)
    shared = -(-int(getattr(text, "shared_expert_intermediate_size", 0) or 0) // expert_intermediate)
    return MoeShape(experts, top_k, expert_intermediate, shared, len(dense))


def _architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else type(config).__name__
