"""The trainer's target-logprob head against a direct torch computation (log_softmax + gather)."""

from __future__ import annotations

import pytest
import torch

from temper.services.trainer.numerics import default_logprob_chunk_tokens
from temper.services.trainer.target_logprobs import head_target_logprobs, target_logprobs


@pytest.mark.parametrize("columns", [1, 3])
def test_values_and_gradient_equal_log_softmax_gather(columns):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 211, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, 211, (37, columns), generator=gen)
    if columns > 1:
        targets[:, 1] = targets[:, 0]  # a column repeating a target: its gradients add up
    upstream = torch.randn(37, columns, generator=gen, dtype=torch.float64)

    ours = target_logprobs(logits, targets)
    (grad_ours,) = torch.autograd.grad(ours, logits, upstream)
    reference = logits.log_softmax(-1).gather(-1, targets)
    (grad_reference,) = torch.autograd.grad(reference, logits, upstream)

    assert ours.shape == (37, columns)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_ours, grad_reference, rtol=0, atol=1e-12)


def test_float32_large_logits_stay_finite_and_match():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(8, 1000, generator=gen) * 60).requires_grad_()
    targets = torch.randint(0, 1000, (8, 1), generator=gen)
    ours = target_logprobs(logits, targets)
    ours.sum().backward()
    grad_ours = logits.grad.clone()
    logits.grad = None
    reference = logits.log_softmax(-1).gather(-1, targets)
    reference.sum().backward()
    assert torch.isfinite(ours).all() and torch.isfinite(grad_ours).all()
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)
    # logits near 200 in float32: each path rounds (logits - lse) at ~1e-5; gradients are in [-1, 1]
    torch.testing.assert_close(grad_ours, logits.grad, rtol=0, atol=2e-5)


def test_default_chunk_keeps_cpu_logits_under_glibc_mmap_threshold():
    assert default_logprob_chunk_tokens(torch.device("cpu"), 49152) == 128  # SmolLM2: 128 x 49152 x 4 B = 24 MiB
    assert default_logprob_chunk_tokens(torch.device("cpu"), 151936) * 151936 * 4 < 32 << 20
    assert default_logprob_chunk_tokens(torch.device("cpu"), 1000) == 1024  # small vocabularies: capped
    assert default_logprob_chunk_tokens(torch.device("cpu"), 10**7) == 16  # huge ones: floored
    assert default_logprob_chunk_tokens(torch.device("cuda"), 49152) == 1024


def test_head_backward_only_on_live_rows_equals_full_computation():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(97, 16, generator=gen, dtype=torch.float64)
    adapter = (torch.randn(97, 16, generator=gen, dtype=torch.float64) * 0.1).requires_grad_()  # a trained head delta
    hidden = torch.randn(29, 16, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 97, (29, 2), generator=gen)
    upstream = torch.randn(29, 2, generator=gen, dtype=torch.float64)
    upstream[::3] = 0.0  # prompt-like positions: no gradient
    upstream[1, 1] = 0.0  # a live row with one dead column

    calls = []

    def logits_of(h, rows):
        calls.append(None if rows is None else rows.tolist())
        return h @ (weight + adapter).T

    reference = (hidden @ (weight + adapter).T).log_softmax(-1).gather(-1, targets)
    ref_hidden, ref_adapter = torch.autograd.grad(reference, [hidden, adapter], upstream)
    ours = head_target_logprobs(hidden, targets, logits_of)
    ours.backward(upstream)  # the trainer's path: the head's trained parameters get theirs in .grad

    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, ref_hidden, rtol=0, atol=1e-12)
    torch.testing.assert_close(adapter.grad, ref_adapter, rtol=0, atol=1e-12)
    # forward: every row; backward: only the 19 rows with a gradient, named to logits_of (for routing)
    assert calls == [None, [i for i in range(29) if i % 3]]
    assert hidden.grad[::3].eq(0).all()


def test_head_with_no_live_row_gives_zero_gradients_not_none():
    head = torch.nn.Linear(8, 11, bias=False).requires_grad_(False)
    adapter = torch.zeros(11, 8, requires_grad=True)
    hidden = torch.randn(5, 8, requires_grad=True)
    out = head_target_logprobs(hidden, torch.zeros(5, 1, dtype=torch.long), lambda h, rows: head(h) + h @ adapter.T)
    (out * 0.0).sum().backward()
    assert hidden.grad is not None and hidden.grad.eq(0).all()
    assert adapter.grad is not None and adapter.grad.eq(0).all()


def test_head_nan_gradient_propagates():
    head = torch.nn.Linear(8, 11, bias=False).requires_grad_(False)
    hidden = torch.randn(4, 8, requires_grad=True)
    upstream = torch.zeros(4, 1)
    upstream[2] = float("nan")
    out = head_target_logprobs(hidden, torch.zeros(4, 1, dtype=torch.long), lambda h, rows: head(h))
    (grad,) = torch.autograd.grad(out, hidden, upstream)
    assert grad[2].isnan().all() and grad[[0, 1, 3]].eq(0).all()
