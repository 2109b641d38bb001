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

from temper.services.lora.deterministic import target_logprobs as logit_minus_lse  # the one formula


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        ctx.save_for_backward(logits, targets, lse)
        return logits.gather(-1, targets) - lse  # logit_minus_lse's formula, keeping lse

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
    checkpointing the head would). The backward recomputes the head only on the rows whose incoming
    gradient is not zero: an SFT datum's prompt positions (weight 0) cost no head matmul, logits or
    head backward, and their share of every gradient is the exact zero the full computation gives. The
    live rows are recomputed as a smaller matmul, so their gradients may differ from the full chunk's
    in the last bits: deterministic mode keeps the full recomputation."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, logits_of) -> torch.Tensor:
        ctx.logits_of = logits_of
        ctx.save_for_backward(hidden, targets)
        return logit_minus_lse(logits_of(hidden, None), targets)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        hidden, targets = ctx.saved_tensors
        logits_of, ctx.logits_of = ctx.logits_of, None
        live = grad.ne(0).any(-1).nonzero().squeeze(-1)  # a NaN gradient counts as live and propagates
        if not live.numel():  # one row with a zero gradient: the head's adapter gets zeros, not None
            live = live.new_zeros(1)
        with torch.enable_grad():
            rows = hidden.index_select(0, live).detach().requires_grad_()
            logits = logits_of(rows, live)
            g = grad.index_select(0, live).to(logits.dtype)
            detached = logits.detach()
            grad_logits = (detached - torch.logsumexp(detached, -1, keepdim=True)).exp_()
            grad_logits.mul_(-g.sum(-1, keepdim=True)).scatter_add_(-1, targets.index_select(0, live), g)
            # into .grad, as reentrant checkpointing does: the head's adapter (or the stacked factors
            # its router hands back) gets its gradient there
            torch.autograd.backward(logits, grad_logits)
        grad_hidden = torch.zeros_like(hidden)
        grad_hidden.index_copy_(0, live, rows.grad.to(grad_hidden.dtype))
        return grad_hidden, None, None


def head_target_logprobs(hidden: torch.Tensor, targets: torch.Tensor, logits_of) -> torch.Tensor:
    """(N, H) hidden states that require grad, (N, K) targets -> (N, K) log p(target) under
    ``logits_of(hidden, rows)``'s float logits (``rows``: which of the N rows ``hidden`` holds,
    ascending; None: all), the head's backward only where the gradient is not zero. Parameters that
    ``logits_of`` trains get their gradients in ``.grad`` during the caller's ``backward()`` (not
    through ``torch.autograd.grad``, which sees the hidden states' only), and only without dropout
    (a recomputation on fewer rows draws other masks)."""
    return _HeadTargetLogprobs.apply(hidden, targets, logits_of)
