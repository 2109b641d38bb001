"""log p(target) from logits with a backward pass that needs one logits-sized buffer.

``logits.log_softmax(-1).gather(-1, targets)`` keeps the V-wide log-softmax for its backward and,
in the backward, allocates a zero-filled V-wide gradient for the gather and another for the
log-softmax: three to four (N, V) tensors per chunk. The gradient has a closed form,

    d/d logits  sum_k g_k (logits[t_k] - logsumexp(logits))  =  scatter(g)  -  (sum_k g_k) softmax(logits)

so the backward builds it in place in a single buffer (the way fused linear cross-entropy kernels
do), and the forward keeps only the (N, 1) log-normalizer besides the logits it was given.
"""

from __future__ import annotations

import torch


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        ctx.save_for_backward(logits, targets, lse)
        return logits.gather(-1, targets) - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = grad.to(logits.dtype)
        # softmax, scaled by -sum_k g_k, then + g_k at each target column: one (N, V) buffer
        grad_logits = (logits - lse).exp_().mul_(-grad.sum(-1, keepdim=True))
        grad_logits.scatter_add_(-1, targets, grad)
        return grad_logits, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, V) float logits, (N, K) int64 targets -> (N, K) log-softmax values at the targets."""
    return _TargetLogprobs.apply(logits, targets)
