"""A linear layer carrying many LoRA adapters, applied per row group in one pass.

``y = W x + sum_a [rows of a] scale_a * B_a A_a dropout_a(x)``. The rows of each adapter are
gathered, multiplied by that adapter's (A, B) and added back with ``index_add``, so the forward
and the backward pass touch only the adapter a row belongs to: gradients land in exactly one
adapter, and rows without an adapter see the base model. Adapters of any rank coexist.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """Which leading-dimension indices of the next forward's inputs belong to which adapter."""

    groups: list[tuple[str, torch.Tensor | None]]   # (adapter key, indices or None for all rows)


class Router:
    """Shared by every MultiLoraLinear of a model; holds the routing of the pass in progress."""

    def __init__(self):
        self._local = threading.local()

    @property
    def current(self) -> Routing | None:
        return getattr(self._local, "routing", None)

    @contextlib.contextmanager
    def route(self, routing: Routing | None):
        previous = self.current
        self._local.routing = routing
        try:
            yield
        finally:
            self._local.routing = previous


class LoraWeights(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float, device, generator=None):
        super().__init__()
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=torch.float32))
        # peft's default init: A ~ kaiming-uniform(a=sqrt(5)), B = 0, so a new adapter is a no-op.
        bound = 1.0 / math.sqrt(in_features)  # = kaiming_uniform_(a=sqrt(5)) bound for this fan-in
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.lora_A.dtype)
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, training=True)
        return (x @ self.lora_A.t()) @ self.lora_B.t() * self.scale


class MultiLoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, router: Router):
        super().__init__()
        self.base = base
        self.router = router
        self.adapters: dict[str, LoraWeights] = {}  # plain dict: adapters are owned by LoraModel

    @property
    def weight(self) -> torch.Tensor:  # transformers looks at lm_head.weight (e.g. for tying)
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        routing = self.router.current
        if routing is None or not self.adapters:
            return out
        for key, rows in routing.groups:
            weights = self.adapters.get(key)
            if weights is None:
                continue
            if rows is None:
                out = out + weights.delta(x).to(out.dtype)
            else:
                out = out.index_add(0, rows, weights.delta(x.index_select(0, rows)).to(out.dtype))
        return out
