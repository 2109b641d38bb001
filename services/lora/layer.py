"""A linear layer carrying many LoRA adapters, applied per row group in one pass.

``y = W x + sum_a [rows of a] scale_a * B_a A_a dropout_a(x)``. Each adapter multiplies only the
rows routed to it, so the forward and the backward pass touch only the adapter a row belongs to:
gradients land in exactly one adapter, and rows without an adapter see the base model. Adapters
of any rank coexist; those of one shape run together as batched matmuls."""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """Which leading-dimension indices of the next forward's inputs belong to which adapter.

    ``groups`` holds (adapter key, indices, or None for all rows). When the groups are consecutive
    ranges from row 0 (the trainer sorts its batch by adapter) every adapter works on a view of
    the input and nothing is copied. Otherwise the rows are sorted once by group (``order``) so
    every layer gathers its input once, runs each adapter on a contiguous slice, and puts all
    deltas back with one gather (``inverse``).
    """

    groups: list[tuple[str, torch.Tensor | None]]
    order: torch.Tensor | None = None            # rows sorted by group, then rows with no adapter
    inverse: torch.Tensor | None = None          # position of each row in ``order``
    segments: list[tuple[str, int, int]] | None = None  # (key, start, stop) slices of the sorted rows
    contiguous: bool = False                     # groups are already consecutive ranges from row 0
    rows: int = 0
    gathers: dict = field(default_factory=dict)  # padded (G, L) row indices per bucket of segments

    def prepare(self, rows: int) -> bool:
        """Compute the sort order for inputs with ``rows`` leading entries (once per pass);
        returns False when a single group covers every row (no reordering needed)."""
        if len(self.groups) == 1 and self.groups[0][1] is None:
            return False
        if self.segments is not None and self.rows == rows:
            return True
        if any(index is None for _, index in self.groups):
            raise ValueError("a group covering all rows must be the only group")
        device = self.groups[0][1].device if self.groups else torch.device("cpu")
        segments, start = [], 0
        for key, index in self.groups:
            segments.append((key, start, start + index.numel()))
            start += index.numel()
        covered = torch.cat([index for _, index in self.groups]) if self.groups else torch.zeros(0, dtype=torch.long)
        self.segments, self.rows = segments, rows
        self.contiguous = bool(torch.equal(covered.cpu(), torch.arange(covered.numel())))
        if self.contiguous:
            return True
        rest = torch.ones(rows, dtype=torch.bool, device=device)
        rest[covered] = False
        self.order = torch.cat([covered, rest.nonzero().squeeze(-1)])
        self.inverse = torch.empty_like(self.order)
        self.inverse[self.order] = torch.arange(rows, device=device)
        return True


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
        if not routing.prepare(x.shape[0]):  # one adapter for every row
            key = routing.groups[0][0]
            return out + self.adapters[key].delta(x).to(out.dtype) if key in self.adapters else out
        if not any(key in self.adapters for key, _, _ in routing.segments):
            return out
        ordered = x if routing.contiguous else x.index_select(0, routing.order)
        spans = self._grouped_deltas(ordered, routing)
        if len(spans) == 1 and spans[0][0] == 0 and spans[0][1] == x.shape[0]:
            delta = spans[0][2]  # every row covered by one batched matmul: no copy at all
        else:
            pieces, at = [], 0
            for start, stop, span in spans:
                if start > at:
                    pieces.append(out.new_zeros((start - at,) + out.shape[1:]))
                pieces.append(span.to(out.dtype))
                at = stop
            if at < x.shape[0]:
                pieces.append(out.new_zeros((x.shape[0] - at,) + out.shape[1:]))
            delta = torch.cat(pieces)
        if not routing.contiguous:
            delta = delta.index_select(0, routing.inverse)
        return out + delta.to(out.dtype)

    def _grouped_deltas(self, ordered: torch.Tensor, routing: Routing) -> list[tuple[int, int, torch.Tensor]]:
        """The present adapters' deltas as (start, stop, delta) spans of ``ordered``, sorted.

        Adapters with the same rank, scale and dropout run as one batched matmul over their slices:
        as a plain view when the slices are adjacent and equally long (one span for all of them),
        else padded to a common length. Many adapters cost a few kernels, not a few each.
        """
        buckets: dict[tuple, list[tuple[LoraWeights, int, int]]] = {}
        for key, start, stop in routing.segments:
            weights = self.adapters.get(key)
            if weights is not None and stop > start:
                buckets.setdefault((weights.rank, weights.scale, weights.dropout), []).append((weights, start, stop))
        spans = []
        for (rank, scale, dropout), members in buckets.items():
            if len(members) == 1:
                weights, start, stop = members[0]
                spans.append((start, stop, weights.delta(ordered[start:stop])))
                continue
            bounds = tuple((start, stop) for _, start, stop in members)
            width = max(stop - start for start, stop in bounds)
            adjacent = all(stop - start == width for start, stop in bounds) and all(
                bounds[g][1] == bounds[g + 1][0] for g in range(len(bounds) - 1))
            if adjacent:  # (G·L, ..., in) rows viewed as (G, L, ..., in)
                padded = ordered[bounds[0][0]: bounds[-1][1]].unflatten(0, (len(members), width))
            else:
                index = routing.gathers.get(bounds)
                if index is None:
                    pad = ordered.shape[0]  # points at the zero row appended below
                    rows = [list(range(start, stop)) + [pad] * (width - (stop - start)) for start, stop in bounds]
                    index = routing.gathers[bounds] = torch.tensor(rows, device=ordered.device)
                padded = torch.cat([ordered, ordered.new_zeros((1,) + ordered.shape[1:])])[index]  # (G, L, ..., in)
            lora_a = torch.stack([w.lora_A for w, _, _ in members])   # (G, r, in)
            lora_b = torch.stack([w.lora_B for w, _, _ in members])   # (G, out, r)
            xs = padded.to(lora_a.dtype).flatten(1, -2)               # (G, L·..., in)
            if dropout > 0:
                xs = F.dropout(xs, dropout, training=True)
            batched = torch.bmm(torch.bmm(xs, lora_a.transpose(1, 2)), lora_b.transpose(1, 2)) * scale
            batched = batched.reshape(padded.shape[:-1] + (lora_b.shape[1],))
            if adjacent:
                spans.append((bounds[0][0], bounds[-1][1], batched.flatten(0, 1)))
            else:
                spans.extend((start, stop, batched[g, : stop - start]) for g, (start, stop) in enumerate(bounds))
        return sorted(spans, key=lambda span: span[0])
