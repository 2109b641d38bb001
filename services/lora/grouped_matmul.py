"""LoRA's two matmuls over ragged groups of rows as two grouped matmuls (``torch.nn.functional.grouped_mm``),
shared by dense LoRA (``layer.py``: one group per adapter) and expert LoRA (``experts.py``: one group per
(adapter, expert) pair, or per expert and span of adapters).

``lowrank`` computes ``B_g A_g x`` on each group's rows, back to back, or answers None where grouped_mm
has no kernel: the caller then runs its own padded batched matmuls. A kernel that raises is recorded
in ``FAILED`` (one record for every caller) and not tried again for that device and dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# "enabled": grouped_mm at all (benchmarks and tests switch it off to time or check the padded fallback).
# On CPU each caller says whether it wants grouped_mm: "dense_cpu" (off: the trainer runs dense LoRA's
# grouped path on CUDA only; tests switch it on to check that path) and "experts_cpu" (on: measured
# faster than padded matmuls on a 2-core CPU). CUDA: bf16 only (sm80+ kernels).
SETTINGS = {"enabled": hasattr(F, "grouped_mm"), "dense_cpu": False, "experts_cpu": True}
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the CPU kernel's dtypes
# (device type, dtype) pairs where grouped_mm raised: padded batched matmuls there from then on
FAILED: set[tuple[str, torch.dtype]] = set()


def usable(device: torch.device, dtype: torch.dtype, *features: int, cpu: bool) -> bool:
    """Whether grouped_mm has a kernel for ``dtype`` on ``device`` (``cpu``: the caller wants it on CPU)
    and every count in ``features`` (fan-in, fan-out, ...) makes a 16-byte stride."""
    if not SETTINGS["enabled"] or (device.type, dtype) in FAILED:
        return False
    if device.type == "cpu":
        if not cpu or dtype not in CPU_DTYPES:
            return False
    elif device.type != "cuda" or dtype != torch.bfloat16:
        return False
    align = _align(dtype)
    return all(n % align == 0 for n in features)


def lowrank(xs: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, offsets: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """``B_g A_g x`` over each group's rows of ``xs`` (rows, in), back to back and ending at ``offsets``
    (int32), with ``lora_a`` (G, r, in) and ``lora_b`` (G, out, r); the low-rank activations times
    ``mask`` (rows, r) where given. None where grouped_mm raises (recorded in ``FAILED``).

    The kernels want every stride a multiple of 16 bytes: the rank and the row count are padded with
    zeros to that (the results are the same; the padded rows belong to no group and are cut off)."""
    align = _align(xs.dtype)
    rows, rank = xs.shape[0], lora_b.shape[2]
    if rank % align:
        lora_a = F.pad(lora_a, (0, 0, 0, -rank % align))
        lora_b = F.pad(lora_b, (0, -rank % align))
        if mask is not None:
            mask = F.pad(mask, (0, -rank % align))
    if rows % align:
        xs = F.pad(xs, (0, 0, 0, -rows % align))
        if mask is not None:
            mask = F.pad(mask, (0, 0, 0, -rows % align))
    matmul = _CpuGroupedMatmul.apply if xs.device.type == "cpu" else _grouped_mm
    try:
        low = matmul(xs, lora_a.transpose(1, 2), offsets)
        if mask is not None:
            low = low * mask
        return matmul(low, lora_b.transpose(1, 2), offsets)[:rows]
    except RuntimeError:  # a kernel this build lacks
        FAILED.add((xs.device.type, xs.dtype))
        return None


def _align(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x, w, offs=offsets)


class _CpuGroupedMatmul(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] @ w[g]`` with grouped_mm in the backward pass too (CPU: torch's own
    backward of grouped_mm asks for strides its CPU kernel refuses)."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return F.grouped_mm(x, w, offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = F.grouped_mm(grad, w.transpose(1, 2), offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = F.grouped_mm(x.t(), grad, offs=offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None
