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
logprob head's chunk; ``benchmarks/memory_estimate.py`` checks it against measured peak memory.
Imports torch only (the GPU benchmark loads the trainer's numerics without temper installed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPE_BYTES = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2}


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
    eager_attention: bool = False   # attention probabilities (heads x width per token) are saved
    # allocator slack and tensors not counted. Measured on SmolLM2 fp32 CPU (memory_estimate.py):
    # the count alone came to 0.9 of the peak stored and 1.1 checkpointed; with 1.15 the estimate is
    # above the measured peak for stored passes (their budget is what matters) and ~5% below it for
    # checkpointed ones (a tenth of the memory).
    overhead: float = 1.15

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, lora_rank: int = 64) -> "ActivationModel":
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        return cls(
            layers=int(text.num_hidden_layers), hidden=hidden,
            intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden), heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
            vocab=int(text.vocab_size), dtype_bytes=DTYPE_BYTES.get(dtype, 4), lora_rank=lora_rank,
            eager_attention=getattr(config, "_attn_implementation", "sdpa") == "eager",
        )

    def layer_elements(self, width: int) -> float:
        """Elements one decoder layer saves for its backward pass, per token (width: the padded row
        length). Per layer: its input and the two RMSNorm outputs (3 h; each norm also saves an
        fp32 1/rms); q after rotary and attention's output and the o_proj input (3 h: q, out, and
        out transposed to contiguous); k and v after rotary, repeated to every head where the
        attention kernel wants that (2 h worst case); the residual after attention (h); gate, up,
        silu(gate) and their product (4 i); a rank-r LoRA intermediate per linear (7 r). Eager
        attention adds its probabilities (heads x width, twice: softmax output and the mask add)."""
        h, i, r = self.hidden, self.intermediate, self.lora_rank
        q = self.heads * self.head_dim
        elements = 3 * h + 3 * q + 2 * q + h + 4 * i + 7 * r + 2
        if self.eager_attention:
            elements += 2 * self.heads * width
        return float(elements)

    def backward_elements(self) -> float:
        """Per token, the backward pass's working set beyond what is saved: the gradient flowing
        through the residual stream and one layer's intermediate gradients (h and i wide)."""
        return float(4 * self.hidden + 3 * self.intermediate)

    def head_bytes(self, chunk_tokens: int) -> float:
        """The logprob head: one chunk's float32 logits and their gradient buffer (target_logprobs)."""
        return 3.0 * chunk_tokens * self.vocab * 4

    def pass_bytes(self, tokens: int, width: int, checkpointed: bool, chunk_tokens: int) -> float:
        """Peak activation memory of one forward+backward pass over ``tokens`` padded tokens."""
        per_layer = self.layer_elements(width)
        if checkpointed:  # every layer's input, one layer's activations at a time
            per_token = self.layers * self.hidden + per_layer
        else:
            per_token = self.layers * per_layer
        per_token += self.backward_elements() + 2 * self.hidden  # + final hidden states and their gradient
        return self.overhead * (tokens * per_token * self.dtype_bytes + self.head_bytes(min(tokens, chunk_tokens)))

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


def activation_budget_bytes(device: torch.device, budget_mib: int, fraction: float) -> int | None:
    """``budget_mib`` when set, else ``fraction`` of the memory available now; None: unknown."""
    if budget_mib > 0:
        return budget_mib << 20
    available = available_memory_bytes(device)
    return None if available is None else int(available * fraction)
