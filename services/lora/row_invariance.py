"""Whether this machine's matmuls are row-invariant for a model, and from how many rows: checked once
per model, before deterministic mode is offered (``deterministic.unsupported``).

Deterministic mode rests on one property of the BLAS underneath: with one intra-op thread and at
least ``deterministic.MIN_ROWS`` rows, a row's result does not depend on how many rows share the
matmul or where it sits among them. That was measured on one CPU (every M from 4 to 299 for the
SmolLM2 shapes); another CPU, BLAS build or device may take differently-reducing paths for more
rows. So each process probes the model's own shapes (its linears, a LoRA factor's, the attention's)
at a few row counts, raises the floor when it must (8, 16, 32, 64: a floor that works keeps working
above it, so the process keeps the largest any of its models needed), and, when none works, says so:
deterministic requests are then refused (FAILED_PRECONDITION) instead of answered with bits that
depend on the batch. The decode steps' stacked adapters (``deterministic_lora._stacked``: a broadcast
matmul and a ``bmm`` over every adapter of one rank) rest on a second property, that those give each
adapter the bits of its own ``linear``; ``stacking_agrees`` checks it, and where it fails decode runs
the adapters one by one as the trainer does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOORS = (8, 16, 32, 64)
PROBE_RANK = 8  # a LoRA factor's inner size: a thin matmul takes other kernels than the base linears
_checked: dict[tuple, int | None] = {}


def _shapes(model) -> tuple[tuple[int, int], ...]:
    """(in, out) of the model's linears, the largest (the vocabulary head) last."""
    found = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return tuple(sorted(found, key=lambda s: s[0] * s[1]))


def _rows_agree(x: torch.Tensor, weight: torch.Tensor, floor: int, counts: tuple[int, ...]) -> bool:
    """Rows of an M-row ``x @ weight.T`` equal the same rows computed alone (padded to ``floor``)."""
    for m in counts:
        full = F.linear(x[:m], weight)
        for i in sorted({0, m // 2, m - 1}):
            alone = F.linear(F.pad(x[i:i + 1], (0, 0, 0, floor - 1)), weight)[0]
            if not torch.equal(full[i], alone):
                return False
    return True


def _attention_agrees(dim: int, kv_heads: int, floor: int, counts: tuple[int, ...], dtype, device, block: int) -> bool:
    """The attention's two batched matmuls (scores over ``dim``, values over a key block) are row-invariant."""
    g = torch.Generator(device="cpu").manual_seed(1)
    keys = torch.randn(1, kv_heads, dim, 3 * block, generator=g).to(device, dtype)
    values = torch.randn(1, kv_heads, 3, block, dim, generator=g).to(device, dtype)
    query = torch.randn(1, kv_heads, max(counts), dim, generator=g).to(device, dtype)
    tiles = torch.randn(1, kv_heads, 3, max(counts), block, generator=g).to(device, dtype)
    for m in counts:
        scores, partial = torch.matmul(query[:, :, :m], keys), torch.matmul(tiles[:, :, :, :m], values)
        for i in sorted({0, m - 1}):
            q = F.pad(query[:, :, i:i + 1], (0, 0, 0, floor - 1))
            t = F.pad(tiles[:, :, :, i:i + 1], (0, 0, 0, floor - 1))
            if not (torch.equal(scores[:, :, i], torch.matmul(q, keys)[:, :, 0])
                    and torch.equal(partial[:, :, :, i], torch.matmul(t, values)[:, :, :, 0])):
                return False
    return True


def _once(key: tuple, compute):
    """``compute()`` on one intra-op thread (the deterministic passes' setting), once per ``key``."""
    if key not in _checked:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                _checked[key] = compute()
        finally:
            torch.set_num_threads(threads)
    return _checked[key]


def row_floor(model, block: int) -> int | None:
    """The smallest of ``FLOORS`` at which the model's matmuls are row-invariant here (one thread);
    None when none is. Once per model shape set, dtype and device."""
    param = next(model.parameters())
    config = getattr(model.config, "text_config", None) or model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    shapes = _shapes(model)
    return _once((shapes, dim, kv_heads, param.dtype, str(param.device)),
                 lambda: _probe(shapes, dim, kv_heads, param.dtype, param.device, block))


def _probe(shapes, dim: int, kv_heads: int, dtype, device, block: int) -> int | None:
    g = torch.Generator(device="cpu").manual_seed(0)
    thin = {(k, PROBE_RANK) for k, _ in shapes} | {(PROBE_RANK, n) for _, n in shapes}
    for floor in FLOORS:
        counts = (floor, floor + 1, floor + 3, 2 * floor + 1, 4 * floor + 3, 131)
        ok = True
        for k, n in [*sorted(thin), *shapes]:
            largest = (k, n) == shapes[-1]  # the vocabulary head: fewer counts, it is by far the costliest
            probe = counts[:3] if largest else counts
            x = torch.randn(max(probe), k, generator=g).to(device, dtype)
            weight = torch.randn(n, k, generator=g).to(device, dtype)
            if not _rows_agree(x, weight, floor, probe):
                ok = False
                break
        if ok and _attention_agrees(dim, kv_heads, floor, counts, dtype, device, block):
            return floor
    return None


def stacking_agrees(model, floor: int, groups: int = 3) -> bool:
    """A broadcast matmul over ``groups`` stacked rank-``PROBE_RANK`` A factors and a ``bmm`` over the B
    factors give each group the bits of its own ``F.linear``s, for the model's linear shapes (one thread)."""
    param, shapes = next(model.parameters()), _shapes(model)
    return bool(_once(("stacking", shapes, floor, param.dtype, str(param.device)),
                      lambda: _stacking(shapes[:-1] or shapes, floor, groups, param.dtype, param.device)))


def _stacking(shapes, floor: int, groups: int, dtype, device) -> bool:
    g = torch.Generator(device="cpu").manual_seed(2)
    for k, n in shapes:  # the vocabulary head takes no adapter
        for rows in (floor, floor + 5, 4 * floor + 3):
            x = torch.randn(rows, k, generator=g).to(device, dtype)
            lora_a = torch.randn(groups, PROBE_RANK, k, generator=g).to(device, dtype)
            lora_b = torch.randn(groups, n, PROBE_RANK, generator=g).to(device, dtype)
            low = torch.matmul(x, lora_a.transpose(1, 2))
            high = torch.bmm(low, lora_b.transpose(1, 2))
            for i in range(groups):
                alone = F.linear(x, lora_a[i])
                if not (torch.equal(low[i], alone) and torch.equal(high[i], F.linear(alone, lora_b[i]))):
                    return False
    return True
