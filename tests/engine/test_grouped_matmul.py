"""services/lora/grouped_matmul.py on its own: ``lowrank`` against a direct per-group torch loop (forward and
every gradient, ragged groups, a rank and a row count its kernels need padded, with and without a mask),
``usable``'s rules, and the fallback: a kernel that raises is recorded once for dense and expert LoRA
alike, and a dense layer then computes the same deltas with padded batched matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from temper.services.lora import experts, grouped_matmul, layer
from temper.services.lora.layer import LoraWeights, MultiLoraLinear, Router, Routing

SIZES = [3, 0, 5, 1, 4]        # rows per group, one empty: 13 rows, not a multiple of 4 (float32) or 8 (bf16)
IN, OUT, RANK = 16, 24, 3      # rank 3: padded to the kernels' 16-byte strides


@pytest.fixture(autouse=True)
def fresh_record(monkeypatch):
    monkeypatch.setattr(grouped_matmul, "FAILED", set())


def direct(xs, lora_a, lora_b, mask=None):
    """Each group's rows times its own A then B, in a Python loop."""
    out, at = [], 0
    for g, n in enumerate(SIZES):
        low = xs[at:at + n] @ lora_a[g].t()
        if mask is not None:
            low = low * mask[at:at + n]
        out.append(low @ lora_b[g].t())
        at += n
    return torch.cat(out)


def inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    rows, groups = sum(SIZES), len(SIZES)
    xs = torch.randn(rows, IN, generator=generator).to(dtype)
    lora_a = torch.randn(groups, RANK, IN, generator=generator).to(dtype)
    lora_b = torch.randn(groups, OUT, RANK, generator=generator).to(dtype)
    mask = (torch.rand(rows, RANK, generator=generator) > 0.4).to(dtype)
    offsets = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    return xs, lora_a, lora_b, mask, offsets


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowrank_matches_a_direct_loop_forward_and_backward(dtype, masked):
    xs, lora_a, lora_b, mask, offsets = inputs(dtype)
    mask = mask if masked else None
    leaves = [t.clone().requires_grad_(True) for t in (xs, lora_a, lora_b)]
    got = grouped_matmul.lowrank(*leaves, offsets, mask)
    assert got is not None and got.shape == (sum(SIZES), OUT) and got.dtype == dtype
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (got * upstream).sum().backward()

    reference = [t.detach().float().requires_grad_(True) for t in (xs, lora_a, lora_b)]
    expected = direct(*reference, None if mask is None else mask.float())
    (expected * upstream.float()).sum().backward()

    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.15, "rtol": 0.02}
    torch.testing.assert_close(got.float(), expected, **tol)
    for leaf, ref in zip(leaves, reference):
        assert leaf.grad.shape == leaf.shape
        torch.testing.assert_close(leaf.grad.float(), ref.grad, **tol)
    assert not grouped_matmul.FAILED


def test_usable_asks_for_a_kernel_the_callers_wish_and_aligned_features(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert grouped_matmul.usable(cpu, torch.float32, 16, 24, cpu=True)
    assert not grouped_matmul.usable(cpu, torch.float32, 16, 24, cpu=False)       # the caller wants it on CUDA only
    assert not grouped_matmul.usable(cpu, torch.float32, 16, 10, cpu=True)        # 40 bytes: not a 16-byte stride
    assert not grouped_matmul.usable(cpu, torch.bfloat16, 16, 12, cpu=True)       # 24 bytes in bf16
    assert grouped_matmul.usable(cpu, torch.bfloat16, 16, 24, cpu=True)
    assert not grouped_matmul.usable(cpu, torch.float64, 16, 24, cpu=True)        # no CPU kernel
    assert not grouped_matmul.usable(cuda, torch.float32, 16, 24, cpu=True)       # CUDA: bf16 only
    monkeypatch.setitem(grouped_matmul.SETTINGS, "enabled", False)
    assert not grouped_matmul.usable(cpu, torch.float32, 16, 24, cpu=True)


def test_a_failed_kernel_is_recorded_once_for_both_callers_and_the_layer_falls_back(monkeypatch):
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[0].shape)
        raise RuntimeError("no kernel for this build")

    monkeypatch.setitem(grouped_matmul.SETTINGS, "dense_cpu", True)
    monkeypatch.setattr(F, "grouped_mm", refuse)
    # a dense layer on ragged back-to-back slices (the grouped path's case): grouped_mm refuses, the
    # layer computes the same deltas with padded batched matmuls
    torch.manual_seed(0)
    dense = MultiLoraLinear(nn.Linear(IN, OUT), Router())
    for key in ("a", "b"):
        weights = LoraWeights(IN, OUT, 4, alpha=8.0, dropout=0.0, device="cpu")
        with torch.no_grad():
            weights.lora_B.normal_()
        dense.adapters[key] = weights
    x = torch.randn(5, 2, IN)
    owners = (("a", [0]), ("b", [1, 2, 3, 4]))
    with dense.router.route(Routing([(key, torch.tensor(rows)) for key, rows in owners])):
        got = dense(x)
    expected = dense.base(x) + torch.cat([dense.adapters[key].delta(x[rows]) for key, rows in owners])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(calls) == 1 and grouped_matmul.FAILED == {("cpu", torch.float32)}

    # one record: neither dense nor expert LoRA tries grouped_mm again for CPU float32; bf16 still may
    xs, lora_a, lora_b, _, offsets = inputs(torch.float32)
    assert not experts._grouped_usable(xs, IN, OUT)
    assert experts._grouped_delta(xs, lora_a, lora_b, offsets) is None
    assert not layer._grouped_mm_ok(xs, torch.float32, torch.zeros(2, 4, IN), torch.zeros(2, OUT, 4))
    assert experts._grouped_usable(xs.bfloat16(), IN, OUT)
    with dense.router.route(Routing([(key, torch.tensor(rows)) for key, rows in owners])):
        torch.testing.assert_close(dense(x), expected, atol=1e-5, rtol=0)
    assert len(calls) == 1
