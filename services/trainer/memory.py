"""How much memory a training pass needs, and how the trainer splits and checkpoints its passes so
that they fit the memory it may use.

A pass of ``rows x width`` padded tokens keeps, per token, every decoder layer's saved activations
(``stored``), or only each layer's input plus one layer's activations while that layer is
recomputed in the backward pass (``checkpointed``: the recompute costs about a third more compute).
The trainer stores activations whenever the pass fits its activation budget, splits a pass into
micro-batches that fit stored when they are not too small, and checkpoints only what cannot fit
otherwise. A token count says nothing about memory: 2048 tokens of a 135M model need ~5 GB stored,
of an 8B model on a GPU ~30 GB.

The estimate counts the tensors autograd saves in a Llama-style decoder layer (frozen base weights,
LoRA on every linear; see ``layer_elements``) plus the backward pass's working set and the
logprob head's chunk; for a vision-language model its images as their N tokens in the rows plus the
vision tower's outputs, and its activations where an adapter trains the tower (``TowerShape``); for the mixture-of-experts families (``families.moe_shape``) their routed
experts as ``MultiLoraExperts`` runs them (top_k sorted copies of every token, LoRA on the experts),
the router, shared experts and dense first layers; for DeepSeek's multi-head latent attention its
low-rank q and compressed kv. ``benchmarks/memory_estimate.py`` checks it against measured peak
memory (``--families``: every family). Imports torch only (the GPU benchmark loads the trainer's
numerics without temper installed; ``families`` imports nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPE_BYTES = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2}

# MultiLoraExperts (services/lora/experts.py) runs the LoRA of all (adapter, expert) pairs as grouped
# matmuls over their rows back to back (its inputs: the routed rows, once), or where grouped_mm has
# no kernel as batched matmuls over slices padded to a common length, in chunks whose longest slice
# is at most PAD_SLACK = 1.25 times the shortest: the inputs hold up to this many rows per routed row.
EXPERT_PADDING = 1.25

# families whose transformers model has no sdpa attention: eager unless flash/flex is asked for
NO_SDPA_FAMILIES = ("gpt_oss",)


@dataclass(frozen=True)
class TowerShape:
    """A vision-language model's vision tower (Qwen3-VL's: ``depth`` blocks of LayerNorm, fused-qkv
    attention over each image's patches and a GELU MLP; a merger of ``merge`` patches into each image
    token, and one more merger per deepstack layer, whose outputs join the decoder's first layers)."""

    hidden: int
    intermediate: int
    depth: int
    merge: int                  # patches per image token (spatial_merge_size squared)
    out_hidden: int             # an image token's embedding (the decoder's hidden size)
    deepstack: int = 0

    @classmethod
    def from_config(cls, config) -> "TowerShape | None":
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        text = getattr(config, "text_config", None) or config
        return cls(hidden=int(vision.hidden_size), intermediate=int(vision.intermediate_size), depth=int(vision.depth),
                   merge=int(vision.spatial_merge_size) ** 2,
                   out_hidden=int(getattr(vision, "out_hidden_size", None) or text.hidden_size),
                   deepstack=len(getattr(vision, "deepstack_visual_indexes", None) or ()))

    def block_elements(self, lora_rank: int) -> float:
        """Per patch, what one tower block saves when gradients run through it (an adapter trains the
        tower): its input and two LayerNorm outputs (3 h), qkv's output (3 h), q and k after rotary (2 h),
        attention's output (h), the residual (h), the MLP's fc1 output and its GELU (2 i), and a LoRA
        intermediate per adapted linear (qkv, proj, fc1, fc2: 4 r)."""
        return float(10 * self.hidden + 2 * self.intermediate + 4 * lora_rank)

    def merger_elements(self, lora_rank: int) -> float:
        """Per image token, each merger (the final one and the deepstack ones): its LayerNorm output,
        fc1's output and GELU (3 x merge h), its output (out_hidden) and 2 LoRA intermediates."""
        return float((1 + self.deepstack) * (3 * self.merge * self.hidden + self.out_hidden + 2 * lora_rank))

    def trained_elements(self, image_tokens: int, lora_rank: int) -> float:
        """A tower pass with gradients over images of ``image_tokens`` tokens: what it saves."""
        patches = image_tokens * self.merge
        return patches * self.depth * self.block_elements(lora_rank) + image_tokens * self.merger_elements(lora_rank)

    def output_elements(self, image_tokens: int) -> float:
        """The tower's outputs a pass holds: per image token its embedding and deepstack features."""
        return float(image_tokens * (1 + self.deepstack) * self.out_hidden)


@dataclass(frozen=True)
class ActivationModel:
    """The shapes that set a pass's activation memory (from a transformers config)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int            # activations (the base model's dtype)
    lora_rank: int = 64         # per adapted linear: a rank-r intermediate (small next to the rest)
    # Llama-style eager attention: its probabilities (heads x width per token) counted twice per layer
    eager_attention: bool = False
    # allocator slack and tensors not counted. Measured on SmolLM2 fp32 CPU (memory_estimate.py):
    # the count alone came to 0.9 of the peak stored and 1.1 checkpointed; with 1.15 the estimate is
    # above the measured peak for stored passes (their budget is what matters) and ~5% below it for
    # checkpointed ones (a tenth of the memory).
    overhead: float = 1.15
    # Mixture of experts (families.moe_shape; 0 experts: a dense model). Of ``layers``, ``dense_layers``
    # have a dense MLP ``intermediate`` wide; the others route every token to ``top_k`` of ``experts``
    # experts ``expert_intermediate`` wide, plus shared experts (one MLP ``shared_intermediate`` wide).
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    expert_glu: int = 3         # the GLU's saved tensors per routed row, in expert_intermediate widths
    expert_padding: float = EXPERT_PADDING   # rows the expert LoRA's padded inputs hold per routed row
    # Multi-head latent attention (DeepSeek; kv_lora_rank > 0): q through a q_lora_rank bottleneck
    # (0: a plain q_proj), k and v from one compressed kv_lora_rank latent plus a shared rope key.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The attention kernel saves its probabilities once per layer and the backward pass holds two
    # more (their gradient and softmax's) for the layer it is in: eager attention of the MoE and MLA
    # families (GPT-OSS has no sdpa), and MLA on sdpa off CUDA (its v head is narrower than q/k,
    # which the fused CPU kernel refuses: sdpa falls back to its math kernel).
    attention_probabilities: bool = False
    # a vision-language model's tower (None: text only); images count as their N tokens in the
    # decoder's rows, the tower's own activations on top (``pass_bytes``'s image arguments)
    tower: TowerShape | None = None

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, lora_rank: int = 64, device=None) -> "ActivationModel":
        """``device`` (a torch.device or its type; None: unknown, counted as off CUDA) decides whether
        MLA's attention runs in a fused kernel (CUDA) or sdpa's math kernel, which saves the attention
        probabilities. A config of no known family is counted as a Llama-style dense model."""
        from temper.services.models import families  # imports neither torch nor transformers

        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        attention = getattr(config, "_attn_implementation", None) or "sdpa"
        try:
            family = families.family_of(config)
            moe = families.moe_shape(config) if family.moe else None
        except families.UnknownFamily:
            family, moe = None, None
        extra: dict = {}
        if moe is not None:
            extra.update(experts=moe.num_experts, top_k=moe.top_k, expert_intermediate=moe.expert_intermediate,
                         shared_intermediate=moe.expert_intermediate * moe.shared_experts, dense_layers=moe.dense_layers,
                         expert_glu=6 if family.name == "gpt_oss" else 3)   # GPT-OSS: clamped gate and up, sigmoid
        mla = family is not None and "kv_b_proj" in family.attention and bool(getattr(text, "kv_lora_rank", 0))
        if family is not None and family.name in NO_SDPA_FAMILIES and attention == "sdpa":
            attention = "eager"
        eager = attention == "eager"
        if mla:
            qk = int(text.qk_nope_head_dim) + int(text.qk_rope_head_dim)
            extra.update(q_lora_rank=int(getattr(text, "q_lora_rank", 0) or 0), kv_lora_rank=int(text.kv_lora_rank),
                         qk_nope_head_dim=int(text.qk_nope_head_dim), qk_rope_head_dim=int(text.qk_rope_head_dim),
                         v_head_dim=int(text.v_head_dim))
            math_kernel = attention == "sdpa" and int(text.v_head_dim) != qk and getattr(device, "type", device) != "cuda"
            extra["attention_probabilities"] = eager or math_kernel
            eager = False
        elif moe is not None:
            extra["attention_probabilities"], eager = eager, False
        intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
        return cls(
            layers=int(text.num_hidden_layers), hidden=hidden, intermediate=int(intermediate), heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
            vocab=int(text.vocab_size), dtype_bytes=DTYPE_BYTES.get(dtype, 4), lora_rank=lora_rank,
            eager_attention=eager, tower=TowerShape.from_config(config), **extra,
        )

    @property
    def moe_layers(self) -> int:
        """Decoder layers with routed experts."""
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def expert_rank(self) -> int:
        """Each routed expert's LoRA rank (services/lora/expert_rank.default_expert_rank of ``lora_rank``)."""
        return max(1, self.lora_rank // max(1, self.top_k))

    def attention_elements(self, width: int) -> float:
        """Per token, what one layer's attention saves besides the layer's input and norms.

        Llama-style: q after rotary, attention's output and the o_proj input (3 q: q, out, and out
        transposed to contiguous); k and v after rotary, repeated to every head where the attention
        kernel wants that (2 q worst case); a rank-r LoRA intermediate per linear (4 r).

        MLA: q_a and its norm (2 q_lora_rank); the compressed kv (kv_lora_rank + rope), its norm
        (kv_lora_rank) and the rotated rope key (rope); kv_b's output, heads x (qk_nope + v: v is a
        view of it); q and k after rope, heads x (qk_nope + qk_rope) each; attention's output and the
        o_proj input (2 heads x v); a LoRA intermediate per linear (q_a, q_b, kv_a, kv_b, o: 5 r; 4
        with a plain q_proj).

        Llama-style eager attention adds its probabilities (heads x width) twice: softmax's output
        and the mask add; ``attention_probabilities`` once (the backward's two: ``backward_elements``)."""
        r = self.lora_rank
        if self.kv_lora_rank:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            elements = (2 * self.q_lora_rank + 2 * self.kv_lora_rank + 2 * self.qk_rope_head_dim
                        + self.heads * (self.qk_nope_head_dim + self.v_head_dim) + 2 * self.heads * qk
                        + 2 * self.heads * self.v_head_dim + (5 if self.q_lora_rank else 4) * r)
        else:
            elements = 5 * self.heads * self.head_dim + 4 * r
        if self.eager_attention:
            elements += 2 * self.heads * width
        elif self.attention_probabilities:
            elements += self.heads * width
        return float(elements)

    def dense_mlp_elements(self, intermediate: int) -> float:
        """Per token, a dense GLU MLP (or the shared experts): gate, up, silu(gate) and their product
        (4 i), a LoRA intermediate per linear (3 r)."""
        return float(4 * intermediate + 3 * self.lora_rank)

    def routed_elements(self) -> float:
        """Per token, one layer's routed experts with LoRA on them, as MultiLoraExperts runs them.

        Every token is ``top_k`` rows sorted by (expert, adapter). Per row: the expert LoRA's inputs,
        padded to the (adapter, expert) slices (h and i wide, ``expert_padding`` rows per row), and
        their rank-r_e intermediates; the two projections' LoRA deltas (2 i and h, kept by index_add);
        the GLU's tensors (``expert_glu`` x i: the gate_up output and silu(gate); GPT-OSS's clamped
        gate and up, sigmoid and product besides); the down output before and after its routing weight,
        and the weight (2 h + 1); the output scattered back (h); int64 indices: the sort order, token,
        rows covered, kept rows and the padded slices' row index. Per token: the router's float32
        probabilities and their mask (E each), the top-k indices (two int64 sets) and weights."""
        h, i, pad = self.hidden, self.expert_intermediate, self.expert_padding
        per_row = pad * (h + i + 2 * self.expert_rank) + (2 + self.expert_glu) * i + 3 * h + 1
        per_row += (4 + pad) * 8 / self.dtype_bytes
        router = (5 * self.experts + 20 * self.top_k) / self.dtype_bytes
        return self.top_k * per_row + router

    def mlp_elements(self, dense: bool) -> float:
        """Per token, one layer's MLP: dense, or routed experts plus the shared ones."""
        if dense or not self.experts:
            return self.dense_mlp_elements(self.intermediate)
        shared = self.dense_mlp_elements(self.shared_intermediate) if self.shared_intermediate else 0.0
        return self.routed_elements() + shared

    def _layer(self, width: int, dense: bool) -> float:
        # the layer's input and the two RMSNorm outputs (3 h; each norm also saves an fp32 1/rms: 2),
        # the residual after attention (h)
        return 4 * self.hidden + 2 + self.attention_elements(width) + self.mlp_elements(dense)

    def layer_elements(self, width: int) -> float:
        """Elements one decoder layer saves for its backward pass, per token (width: the padded row
        length); of a model with dense and MoE layers, the larger. A Llama-style layer: its input and
        the two RMSNorm outputs (3 h; each norm also saves an fp32 1/rms); attention
        (``attention_elements``: 5 q + 4 r); the residual after attention (h); gate, up, silu(gate)
        and their product (4 i) and 3 LoRA intermediates. An MoE layer: ``routed_elements`` and the
        shared experts instead of the MLP."""
        if not self.moe_layers:
            return self._layer(width, True)
        return max(self._layer(width, False), self._layer(width, True) if self.dense_layers else 0.0)

    def decoder_elements(self, width: int) -> float:
        """Per token, every decoder layer's saved activations (its dense and MoE layers)."""
        moe = self.moe_layers
        return (self.layers - moe) * self._layer(width, True) + (moe * self._layer(width, False) if moe else 0.0)

    def expert_factor_elements(self, rows: int, tokens: int) -> float:
        """Per pass, per MoE layer: the expert LoRA factors stacked for the (adapter, expert) pairs
        with rows (r_e x (2 h + 3 i) each: both projections' A and B); at most ``experts`` pairs per
        row of the pass (a row has one adapter) and one per routed row."""
        if not self.moe_layers:
            return 0.0
        pairs = min(max(1, rows) * self.experts, tokens * self.top_k)
        return float(pairs * self.expert_rank * (2 * self.hidden + 3 * self.expert_intermediate))

    def backward_elements(self, width: int = 0) -> float:
        """Per token, the backward pass's working set beyond what is saved: the gradient flowing
        through the residual stream and one layer's intermediate gradients (h and i wide; of a
        routed layer, top_k rows h and expert_intermediate wide, and the shared experts'). With
        ``attention_probabilities``, the attention's backward holds two heads x width gradients of
        them instead: by then its layer's MLP tensors are freed, so the larger of the two counts."""
        h = self.hidden
        if not self.moe_layers:
            working = 4 * h + 3 * self.intermediate
        else:
            routed = 4 * h + self.top_k * (2 * h + 3 * self.expert_intermediate) + 3 * self.shared_intermediate
            working = max(4 * h + 3 * self.intermediate if self.dense_layers else 0, routed)
        if self.attention_probabilities:
            working = max(working, 4 * h + 2 * self.heads * width)
        return float(working)

    def head_bytes(self, chunk_tokens: int) -> float:
        """The logprob head: one chunk's float32 logits and their gradient buffer (target_logprobs)."""
        return 3.0 * chunk_tokens * self.vocab * 4

    def tower_elements(self, image_tokens: int, trained_tokens: int) -> tuple[float, float]:
        """A pass's vision-tower memory: the outputs of its ``image_tokens`` image tokens (held until
        the decoder's backward), and what the tower saves for the ``trained_tokens`` of them whose
        adapter trains it (0 for the rest: the base tower runs without gradients)."""
        if self.tower is None or not image_tokens:
            return 0.0, 0.0
        trained = self.tower.trained_elements(trained_tokens, self.lora_rank) if trained_tokens else 0.0
        return self.tower.output_elements(image_tokens), trained

    def pass_bytes(self, tokens: int, width: int, checkpointed: bool, chunk_tokens: int, image_tokens: int = 0,
                   trained_image_tokens: int = 0) -> float:
        """Peak activation memory of one forward+backward pass over ``tokens`` padded tokens, of which
        ``image_tokens`` are images (``trained_image_tokens`` of them through a tower an adapter trains)."""
        rows = tokens // max(1, width)
        if checkpointed:  # every layer's input, one layer's activations at a time
            per_token = self.layers * self.hidden + self.layer_elements(width)
            factors = self.expert_factor_elements(rows, tokens)
        else:
            per_token = self.decoder_elements(width)
            factors = self.moe_layers * self.expert_factor_elements(rows, tokens)
        per_token += self.backward_elements(width) + 2 * self.hidden  # + final hidden states and their gradient
        decoder = tokens * per_token + factors
        outputs, tower = self.tower_elements(image_tokens, trained_image_tokens)
        # checkpointed, a trained tower is recomputed after the decoder's backward freed its activations
        elements = outputs + (max(decoder, tower) if checkpointed else decoder + tower)
        return self.overhead * (elements * self.dtype_bytes + self.head_bytes(min(tokens, chunk_tokens)))

    def stored_tokens(self, budget: float, width: int, chunk_tokens: int) -> int:
        """The most padded tokens (rows of ``width``) whose stored activations fit ``budget``."""
        one = self.pass_bytes(width, width, False, chunk_tokens) / width  # per token, head included
        return max(0, int(budget // one))


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory now: on CPU the host's MemAvailable, on CUDA the device's free memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: line.split()[1] for line in f}
        return int(fields["MemAvailable"]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def device_memory_bytes(device: torch.device) -> int:
    """The device's whole memory (a GPU's, or the host's for CPU), 0 if unknown: what a trainer registers."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo") as f:
            return int(next(line.split()[1] for line in f if line.startswith("MemTotal:"))) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def device_memory_used_bytes(device: torch.device) -> int:
    """Memory in use now: a GPU's (total - free, whoever holds it), this process's resident set on CPU;
    0 if unknown. What GetModelInfo answers for the operator's status."""
    try:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int(total - free)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, RuntimeError, ValueError, IndexError):
        return 0


def activation_budget_bytes(device: torch.device, budget_mib: int, fraction: float) -> int | None:
    """``budget_mib`` when set, else ``fraction`` of the memory available now; None: unknown."""
    if budget_mib > 0:
        return budget_mib << 20
    available = available_memory_bytes(device)
    return None if available is None else int(available * fraction)
