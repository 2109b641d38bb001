"""Loss functions on target logprobs (torch), with Tinker's math (shared/docs/tinker-wire-spec.md §3).

Each takes lp = log p(target) of the current model (B, T[, K]), the loss inputs padded to the same
shape, and the loss config; it returns the elementwise loss and per-token statistics that become
``name:mean`` metrics. Losses are SUMMED over tokens and datums (no mean); the client scales.
"""

from __future__ import annotations

from typing import Callable

import torch

Stats = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], tuple[torch.Tensor, Stats]]


def cross_entropy(lp, inputs, config):
    return -lp * inputs["weights"], {}


def _ratio(lp, inputs) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])


def importance_sampling(lp, inputs, config):
    ratio = _ratio(lp, inputs)
    return -ratio * inputs["advantages"], {"ratio": ratio.detach()}


def ppo(lp, inputs, config):
    ratio = _ratio(lp, inputs)
    advantages = inputs["advantages"]
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    was_clipped = (clipped * advantages < ratio * advantages).float()
    return -objective, {"ratio": ratio.detach(), "clip_fraction": was_clipped}


def cispo(lp, inputs, config):
    ratio = _ratio(lp, inputs)
    weight = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    was_clipped = (weight != ratio.detach()).float()
    return -weight * lp * inputs["advantages"], {"ratio": ratio.detach(), "clip_fraction": was_clipped}


def dro(lp, inputs, config):
    diff = lp - inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * diff**2), {"ratio": torch.exp(diff).detach()}


LOSS_FNS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}
