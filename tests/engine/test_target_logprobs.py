"""The trainer's target-logprob head against a direct torch computation (log_softmax + gather)."""

from __future__ import annotations

import pytest
import torch

from temper.services.trainer.numerics import default_logprob_chunk_tokens
from temper.services.trainer.target_logprobs import target_logprobs


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
