"""Loss functions on target logprobs (torch), with Tinker's math (shared/docs/tinker-wire-spec.md §3).

Each takes lp = log p(target) of the current model (B, T[, K]), the loss inputs padded to the same
shape, and the loss config; it returns the elementwise loss and per-token statistics that become
``name:mean`` metrics. Losses are SUMMED over tokens and datums (no mean); the client scales.
One row of the batch is one datum, so a reduction over the last (token) axis is a per-datum one.

Loss positions (``loss_positions``): the targets that carry loss. For cross_entropy, a nonzero
weight; for the RL losses, a nonzero advantage or sampler logprob. RL datums pad their prompt
targets with logprob 0 and advantage 0 (the cookbook does), so those are left out. Statistics are
averaged over these positions only: an exactly on-policy batch reads ``ratio:mean`` 1.0, whatever
the prompt length. The sequence-level losses take their per-datum means over the same positions.

``gspo`` (Tinker's documented GSPO-token, Zheng et al. 2025, arXiv 2507.18071). With M the
positions where ``sequence_ratio_mask`` != 0 (the loss positions when a datum has no mask):
    s     = exp(mean_{t in M} (lp_t - q_t))              per datum, no gradient
    r_t   = s * exp(lp_t - sg(lp_t))                     value s, gradient of lp_t
    loss  = -sum_t min(r_t * A_t, clip(r_t, lo, hi) * A_t)
lo/hi are ``clip_low_threshold``/``clip_high_threshold``; Tinker does not publish its defaults, so
Temper takes the paper's clipping ranges 3e-4 / 4e-4: lo = 0.9997, hi = 1.0004.

``stable_reinforce``: Tinker's objective is not published (its docs say only that it is a REINFORCE
variant using information recorded at sampling time, keyed by ``sequence_id``). Temper computes a
REINFORCE loss with a truncated, length-normalised per-sequence importance weight, from the datum
alone (q, the sampler logprobs, is the information it needs; provenance spans and
``record_stability_info`` are accepted and not needed). With P a datum's loss positions:
    w     = clip(exp(mean_{t in P} (lp_t - q_t)), lo, hi)   per datum, no gradient
    kl_t  = exp(lp_t - q_t) - 1 - (lp_t - q_t)              on P (k3 estimate of KL(q || p))
    loss  = -sum_t w * A_t * lp_t  +  kl_coeff * sum_{t in P} kl_t
Defaults lo = 0, hi = 2 (truncated importance sampling), kl_coeff = 0. On-policy w = 1 and the
gradient is importance_sampling's; off-policy the geometric-mean weight does not grow with length
and the cap bounds the variance. Temper's result will not match Tinker's numerically.

Ratios (``_exp_ratio``): every exp(lp - q) (and GSPO's s) is taken of a log-ratio capped at
``MAX_LOG_RATIO``. Only the value is capped: the gradient is still the ratio's (exp at the capped
value) times that of lp. A log-ratio of 20 (the current model 5e8 times likelier than the sampler) is
far off any policy; below it the result is exactly exp's. Without the cap, sampler logprobs that
validation allows (down to -1e6) overflow float32 exp and make the loss infinite or NaN.
"""

from __future__ import annotations

from typing import Callable

import torch

Stats = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], tuple[torch.Tensor, Stats]]


def loss_positions(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool mask of the targets that carry loss (module docstring); padding is all zeros, so out."""
    if "weights" in inputs:
        return inputs["weights"] != 0
    return (inputs["advantages"] != 0) | (inputs["logprobs"] != 0)


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` along the token axis, kept as (B, 1); 0 for an empty row.
    ``where``, not a product: the excluded values may be large (lp - 0 on a prompt)."""
    total = torch.where(mask, values, torch.zeros_like(values)).sum(-1, keepdim=True)
    return total / mask.sum(-1, keepdim=True).clamp(min=1)


def cross_entropy(lp, inputs, config):
    return -lp * inputs["weights"], {}


MAX_LOG_RATIO = 20.0  # exp(20) * the largest advantage (1e6) summed over a long datum stays far from float32's max


def _exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio), its value capped at exp(MAX_LOG_RATIO) (module docstring). Below the cap the
    added term is exactly 0: the value is exp's bit for bit, the gradient exp's."""
    detached = log_ratio.detach()
    return torch.exp(detached.clamp(max=MAX_LOG_RATIO) + (log_ratio - detached))


def _ratio(lp, inputs) -> torch.Tensor:
    return _exp_ratio(lp - inputs["logprobs"])


def importance_sampling(lp, inputs, config):
    ratio = _ratio(lp, inputs)
    return -ratio * inputs["advantages"], {"ratio": ratio.detach()}


def _clipped_objective(ratio, advantages, config):
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    was_clipped = (clipped * advantages < ratio * advantages).float()
    return -objective, {"ratio": ratio.detach(), "clip_fraction": was_clipped}


def ppo(lp, inputs, config):
    return _clipped_objective(_ratio(lp, inputs), inputs["advantages"], config)


def cispo(lp, inputs, config):
    ratio = _ratio(lp, inputs)
    weight = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    was_clipped = (weight != ratio.detach()).float()
    return -weight * lp * inputs["advantages"], {"ratio": ratio.detach(), "clip_fraction": was_clipped}


def dro(lp, inputs, config):
    diff = lp - inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * diff**2), {"ratio": _exp_ratio(diff).detach()}


def _sequence_ratio_positions(inputs) -> torch.Tensor:
    """GSPO's M: ``sequence_ratio_mask`` != 0 where a datum sent one. The trainer fills an optional
    input a datum lacks with NaN (never a wire value: validation refuses NaN); those rows, and a
    request without the mask, use the loss positions."""
    fallback = loss_positions(inputs)
    mask = inputs.get("sequence_ratio_mask")
    if mask is None:
        return fallback
    absent = torch.isnan(mask).any(-1, keepdim=True)
    return torch.where(absent, fallback, mask != 0)


def gspo(lp, inputs, config):
    log_s = _row_mean((lp - inputs["logprobs"]).detach(), _sequence_ratio_positions(inputs))
    ratio = _exp_ratio(log_s + lp - lp.detach())
    return _clipped_objective(ratio, inputs["advantages"], config)


def stable_reinforce(lp, inputs, config):
    positions = loss_positions(inputs)
    diff = lp - inputs["logprobs"]
    raw = _exp_ratio(_row_mean(diff.detach(), positions))
    weight = raw.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    ratio = _exp_ratio(diff)
    kl = torch.where(positions, ratio - 1 - diff, torch.zeros_like(diff))
    loss = -weight * inputs["advantages"] * lp
    if config["kl_coeff"]:  # left out at 0: no term (and no 0 * a huge kl) in the loss or its graph
        loss = loss + config["kl_coeff"] * kl
    was_clipped = (weight != raw).float().expand_as(lp)
    return loss, {"ratio": ratio.detach(), "clip_fraction": was_clipped, "kl": kl.detach()}


LOSS_FNS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
