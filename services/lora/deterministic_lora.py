"""A ``MultiLoraLinear``'s forward in deterministic mode (docs/deterministic.md): the base weight and
both adapter factors through batch-invariant matmuls, each routed row's ``(x A^T) B^T * scale`` added
to its base output once (``out + delta``, as the default forward does).

Passes with gradients (the trainer's) run each adapter on its own rows with ``deterministic.linear``.
Small no-grad passes on CPU (a decode step: every adapter of the batch in every layer, at every step) run
the adapters of one rank on all rows as two batched matmuls, their factors stacked once per
deterministic scope: measured on this CPU, row i of the batched products has the bits of the
per-adapter ``linear`` (bmm and mm row-invariant from 4 rows; rows are padded to MIN_ROWS), so a
decoded token's numbers stay those of the trainer's forward, for a few kernels instead of a few per
adapter. Other adapters' rows cost little: rank-r factors are ~r/N of the base weight's work."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from temper.services.lora import deterministic as det

STACK_ROWS = 64  # at most this many rows: every adapter on every row costs less than gathering them
STACKING = True  # off where this machine's stacked products differ from the per-adapter ones (row_invariance.py)


def lora_linear(layer, x: torch.Tensor) -> torch.Tensor:
    out = det.linear(x, layer.base.weight, layer.base.bias)
    routing = layer.router.current
    if routing is None or not layer.adapters:
        return out
    present = [(key, index, layer.adapters[key]) for key, index in routing.groups if key in layer.adapters]
    for key, _, weights in present:
        if weights.dropout > 0:
            raise RuntimeError(f"adapter {key} has LoRA dropout {weights.dropout}: no deterministic mode with dropout")
    if not present:
        return out
    dtype = layer.router.compute_dtype(x)
    if STACKING and not torch.is_grad_enabled() and x.device.type == "cpu" and x.numel() // max(x.shape[-1], 1) <= STACK_ROWS:
        # no-grad only (a backward through the stacked rows would sum gradient terms of other rows);
        # CPU only: bmm == per-adapter mm was measured there, not with a GPU's kernels
        return _stacked(layer, x, out, routing, present, dtype)
    for _, index, weights in present:
        rows = x if index is None else x.index_select(0, index)
        delta = (det.linear(det.linear(rows.to(dtype), weights.lora_A.to(dtype)), weights.lora_B.to(dtype))
                 * weights.scale).to(out.dtype)
        out = out + delta if index is None else out.index_add(0, index, delta)
    return out


def _stacked(layer, x: torch.Tensor, out: torch.Tensor, routing, present: list, dtype: torch.dtype) -> torch.Tensor:
    """Every present adapter on all of ``x``'s rows, one rank at a time; each row takes its own
    adapter's delta (``index_add``: one addition per element, the same as ``out + delta``)."""
    flat = x.reshape(-1, x.shape[-1]).to(dtype)
    rows = flat.shape[0]
    if rows < det.MIN_ROWS:
        flat = F.pad(flat, (0, 0, 0, det.MIN_ROWS - rows))
    per_row = rows // x.shape[0]                                          # tokens of each routed (leading) row
    plain = out.reshape(rows, -1)
    for lora_a, lora_b, scales, take, into in _buckets(layer, routing, present, x.shape[0], per_row, flat.shape[0], dtype):
        low = torch.matmul(flat, lora_a.transpose(1, 2))                  # (G, M, r): x A_g^T for each g
        high = torch.bmm(low, lora_b.transpose(1, 2))                     # (G, M, out)
        delta = high.flatten(0, 1).index_select(0, take) * scales         # each row's own adapter's delta
        plain = plain.index_add(0, into, delta.to(out.dtype))
    return plain.reshape(out.shape)


def _buckets(layer, routing, present: list, leading: int, per_row: int, padded: int, dtype: torch.dtype) -> list:
    """Per rank: stacked A (G, r, in) and B (G, out, r) in ``dtype``, each routed token's scale (n, 1),
    its row of the flattened (G * padded, out) products and its row of the output. Built once per scope
    and routing (the scope's weights are fixed)."""
    memo = det.memo()
    key = (id(layer), id(routing), leading, per_row)
    hit = memo.get(key)
    if hit is not None and hit[0] is routing:  # (the routing is held, so its id is not reused meanwhile)
        return hit[1]
    device = layer.base.weight.device
    tokens = torch.arange(per_row, device=device)
    by_rank: dict[int, list] = {}
    for _, index, weights in present:
        by_rank.setdefault(weights.rank, []).append((index, weights))
    buckets = []
    for members in by_rank.values():
        takes, intos, scales = [], [], []
        for g, (index, weights) in enumerate(members):
            lead = torch.arange(leading, device=device) if index is None else index.to(device)
            into = (lead[:, None] * per_row + tokens).flatten()
            takes.append(g * padded + into)
            intos.append(into)
            scales.append(torch.full((into.numel(), 1), weights.scale, dtype=dtype, device=device))
        lora_a = torch.stack([w.lora_A.detach() for _, w in members]).to(dtype)
        lora_b = torch.stack([w.lora_B.detach() for _, w in members]).to(dtype)
        buckets.append((lora_a, lora_b, torch.cat(scales), torch.cat(takes), torch.cat(intos)))
    memo[key] = (routing, buckets)
    return buckets
