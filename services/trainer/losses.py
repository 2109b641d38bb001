"""Loss functions on target logprobs (torch). Each returns the summed loss and per-token losses.

Tinker semantics: losses are SUMMED over tokens and datums (no mean); the client scales weights.
"""

from __future__ import annotations

from typing import Callable

import torch

# (target_logprobs (B,T), inputs {name: (B,T) tensor}, config) -> elementwise loss (B,T)
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


def cross_entropy(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    return -logprobs * inputs["weights"]


LOSS_FNS: dict[str, LossFn] = {"cross_entropy": cross_entropy}
