"""Adam hyperparameters as the client sends them and the trainer applies them (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0   # 0: no clipping
