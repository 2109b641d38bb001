"""MultiLoraLinear on its own: every routing shape (views, padded batches, gathers, rows without an
adapter, mixed ranks) against a direct per-row torch computation, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from temper.services.lora.layer import LoraWeights, MultiLoraLinear, Router, Routing

IN, OUT, T = 12, 10, 5


def make_layer(ranks: dict[str, int]) -> MultiLoraLinear:
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(IN, OUT), Router())
    for key, rank in ranks.items():
        weights = LoraWeights(IN, OUT, rank, alpha=2.0 * rank, dropout=0.0, device="cpu")
        with torch.no_grad():
            weights.lora_B.normal_()  # a fresh adapter is a no-op; give it something to do
        layer.adapters[key] = weights
    return layer


def direct(layer: MultiLoraLinear, x: torch.Tensor, owner: list[str | None]) -> torch.Tensor:
    rows = []
    for r, key in enumerate(owner):
        y = layer.base(x[r])
        if key is not None:
            w = layer.adapters[key]
            y = y + (x[r] @ w.lora_A.t()) @ w.lora_B.t() * w.scale
        rows.append(y)
    return torch.stack(rows)


CASES = {
    # owner of each row; groups are built in first-appearance order
    "adjacent equal slices (views)": ["a", "a", "b", "b", "c", "c"],
    "adjacent unequal slices (padded)": ["a", "b", "b", "b", "c", "c"],
    "interleaved rows (gathered)": ["a", "b", "a", "c", "b", "c"],
    "rows without an adapter": ["a", None, "b", "b", None, "a"],
    "trailing rows without an adapter": ["a", "a", "b", "b", None, None],
    "mixed ranks, one bucket split by another": ["a", "a", "r8", "r8", "b", "b"],
}


@pytest.mark.parametrize("owner", CASES.values(), ids=CASES.keys())
def test_every_routing_shape_matches_a_direct_per_row_computation(owner):
    layer = make_layer({"a": 4, "b": 4, "c": 4, "r8": 8})
    x = torch.randn(len(owner), T, IN)
    groups: dict[str, list[int]] = {}
    for r, key in enumerate(owner):
        if key is not None:
            groups.setdefault(key, []).append(r)
    routing = Routing([(key, torch.tensor(rows)) for key, rows in groups.items()])

    x1 = x.clone().requires_grad_(True)
    with layer.router.route(routing):
        y = layer(x1)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    got = {k: (w.lora_A.grad.clone(), w.lora_B.grad.clone()) for k, w in layer.adapters.items() if w.lora_A.grad is not None}
    for w in layer.adapters.values():
        w.lora_A.grad = w.lora_B.grad = None

    x2 = x.clone().requires_grad_(True)
    expected = direct(layer, x2, owner)
    (expected * upstream).sum().backward()

    torch.testing.assert_close(y, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=0)
    assert set(got) == set(groups)  # no gradient in an adapter without rows
    for key, (grad_a, grad_b) in got.items():
        torch.testing.assert_close(grad_a, layer.adapters[key].lora_A.grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(grad_b, layer.adapters[key].lora_B.grad, atol=1e-5, rtol=0)
