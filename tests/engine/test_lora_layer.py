"""MultiLoraLinear on its own: every routing shape (views, padded batches, grouped matmuls, gathers,
rows without an adapter, mixed ranks) against a direct per-row torch computation, forward and
backward, with stacked weights built per call or once per stacking() scope."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from temper.services.lora import grouped_matmul
from temper.services.lora.layer import LoraWeights, MultiLoraLinear, Router, Routing

IN, OUT, T = 16, 12, 5   # 16-byte multiples in float32: grouped_mm's strides


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


MODES = ("stacked per call", "stacked per scope", "grouped_mm per scope")


@pytest.fixture(params=MODES)
def mode(request, monkeypatch):
    # grouped_mm runs on CUDA only in the trainer; its CPU kernel checks the same code path here
    monkeypatch.setitem(grouped_matmul.SETTINGS, "dense_cpu", request.param.startswith("grouped_mm"))
    return request.param


def routing_for(owner: list[str | None]) -> tuple[Routing, dict[str, list[int]]]:
    groups: dict[str, list[int]] = {}
    for r, key in enumerate(owner):
        if key is not None:
            groups.setdefault(key, []).append(r)
    return Routing([(key, torch.tensor(rows)) for key, rows in groups.items()]), groups


@pytest.mark.parametrize("owner", CASES.values(), ids=CASES.keys())
def test_every_routing_shape_matches_a_direct_per_row_computation(owner, mode):
    layer = make_layer({"a": 4, "b": 4, "c": 4, "r8": 8})
    x = torch.randn(len(owner), T, IN)
    routing, groups = routing_for(owner)

    x1 = x.clone().requires_grad_(True)
    scope = layer.router.stacking() if mode.endswith("per scope") else contextlib.nullcontext()
    with scope:
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
        torch.testing.assert_close(grad_a, layer.adapters[key].lora_A.grad, atol=1e-5, rtol=1e-5)  # fp32 summation order
        torch.testing.assert_close(grad_b, layer.adapters[key].lora_B.grad, atol=1e-5, rtol=1e-5)


def test_a_scope_adds_its_gradients_to_earlier_ones_and_spans_several_passes(mode):
    """Two passes in one stacking() scope on top of gradients already there give what two plain
    passes give; adapters without rows keep no gradient."""
    owner = ["a", "a", "b", "b", "c", "c"] if mode != "grouped_mm per scope" else ["a", "b", "b", "b", "c", "c"]
    layers = {name: make_layer({"a": 4, "b": 4, "c": 4, "idle": 4}) for name in ("scoped", "plain")}
    xs = [torch.randn(len(owner), T, IN) for _ in range(2)]
    routing, _ = routing_for(owner)
    for name, layer in layers.items():
        for w in layer.adapters.values():  # an earlier cycle's pending gradient
            w.lora_A.grad = torch.ones_like(w.lora_A) if w is not layer.adapters["idle"] else None
        with layer.router.stacking() if name == "scoped" else contextlib.nullcontext():
            for x in xs:
                with layer.router.route(routing):
                    layer(x).pow(2).sum().backward()
    scoped, plain = layers["scoped"].adapters, layers["plain"].adapters
    assert scoped["idle"].lora_A.grad is None and scoped["idle"].lora_B.grad is None
    for key in ("a", "b", "c"):
        torch.testing.assert_close(scoped[key].lora_A.grad, plain[key].lora_A.grad, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(scoped[key].lora_B.grad, plain[key].lora_B.grad, atol=1e-5, rtol=1e-6)


def test_an_exception_in_a_scope_hands_back_nothing():
    layer = make_layer({"a": 4, "b": 4})
    routing, _ = routing_for(["a", "a", "b", "b"])
    with pytest.raises(RuntimeError, match="boom"):
        with layer.router.stacking():
            with layer.router.route(routing):
                layer(torch.randn(4, T, IN)).sum().backward()
            raise RuntimeError("boom")
    assert all(w.lora_A.grad is None and w.lora_B.grad is None for w in layer.adapters.values())
    assert layer.router.stacks is None


@pytest.mark.parametrize("owner", [CASES["adjacent equal slices (views)"], CASES["interleaved rows (gathered)"]])
def test_lora_math_in_bfloat16_stays_close_to_float32(owner):
    """A bf16 base (activations bf16): LoRA math in bf16 vs in float32 on the same inputs. The bound is
    bf16's own rounding (2^-8 relative) on outputs and on the float32 adapters' gradients."""
    out = {}
    for math_dtype in ("activation", "float32"):
        torch.manual_seed(0)
        layer = make_layer({"a": 4, "b": 4, "c": 4})
        layer.router.math_dtype = math_dtype
        layer.base.to(torch.bfloat16)
        x = torch.randn(len(owner), T, IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        routing, _ = routing_for(owner)
        with layer.router.stacking():
            with layer.router.route(routing):
                y = layer(x)
            y.float().pow(2).sum().backward()
        out[math_dtype] = (y.float(), {k: (w.lora_A.grad, w.lora_B.grad) for k, w in layer.adapters.items()})
        assert all(w.lora_A.grad.dtype == torch.float32 for w in layer.adapters.values())
    (y16, g16), (y32, g32) = out["activation"], out["float32"]
    torch.testing.assert_close(y16, y32, atol=0.05, rtol=0.02)
    for key in g32:
        for a, b in zip(g16[key], g32[key]):
            assert float((a - b).norm() / b.norm()) < 0.02


def test_a_strided_input_reaches_the_base_matmul_contiguous_with_the_same_values():
    # the last position of each prompt (logits_to_keep=1) is a strided view; the CPU matmul copies the
    # weight once per row for such an input, so the layer hands the base a contiguous copy
    layer = make_layer({"a": 2})
    seen = []
    layer.base.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    hidden = torch.randn(3, T, IN)
    last = hidden[:, -1:, :]
    assert not last.is_contiguous()
    with layer.router.route(Routing([("a", torch.tensor([0, 2]))])):
        out = layer(last)
    assert seen == [True]
    torch.testing.assert_close(out, direct(layer, last, ["a", None, "a"]))
