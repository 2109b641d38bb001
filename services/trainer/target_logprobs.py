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


class _HeadTargetLogprobs(torch.autograd.Function):
    """log p(target) through an output head, keeping only the head's input for the backward pass (as
    activation checkpointing would). The backward recomputes the head only on the positions whose
    incoming gradient is not zero: the prompt positions of an SFT datum (weight 0), or any position a
    loss gives no gradient, cost no head matmul, logits or head backward there, and their hidden-state
    gradient is exactly the zero the full computation would give. ``head(hidden, rows)`` returns float
    logits of ``hidden``, the chunk's rows ``rows`` (None: all of them), routed as those rows are."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, head) -> torch.Tensor:
        with torch.no_grad():
            logits = head(hidden, None)
            out = logits.gather(-1, targets) - torch.logsumexp(logits, dim=-1, keepdim=True)
        ctx.head = head
        ctx.save_for_backward(hidden, targets)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        hidden, targets = ctx.saved_tensors
        live = grad.ne(0).any(-1).nonzero().squeeze(-1)  # NaN counts as live: it propagates as before
        grad_hidden = torch.zeros_like(hidden)
        if live.numel():
            with torch.enable_grad():
                rows = hidden.index_select(0, live).detach().requires_grad_()
                logits = ctx.head(rows, live)
                g = grad.index_select(0, live).to(logits.dtype)
                detached = logits.detach()
                grad_logits = (detached - torch.logsumexp(detached, dim=-1, keepdim=True)).exp_().mul_(-g.sum(-1, keepdim=True))
                grad_logits.scatter_add_(-1, targets.index_select(0, live), g)
                # the head's own trained parameters (an adapter on lm_head) get their gradient here
                torch.autograd.backward(logits, grad_logits)
            grad_hidden.index_copy_(0, live, rows.grad.to(grad_hidden.dtype))
        ctx.head = None
        return grad_hidden, None, None


def head_target_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head) -> torch.Tensor:
    """(N, H) hidden states, (N, K) targets -> (N, K) log p(target) under ``head(hidden, rows)``'s float
    logits; the backward pass recomputes the head only where the gradient is not zero. ``hidden``
    must require grad for the head's parameters to get theirs, which land in their ``.grad`` (as with
    reentrant checkpointing: ``backward()``, not ``torch.autograd.grad``)."""
    return _HeadTargetLogprobs.apply(hidden, targets, head)
