"""A linear layer carrying many LoRA adapters, applied per row group in one pass.

``y = W x + sum_a [rows of a] scale_a * B_a A_a dropout_a(x)``. Each adapter multiplies only the
rows routed to it, so the forward and the backward pass touch only the adapter a row belongs to:
gradients land in exactly one adapter, and rows without an adapter see the base model. Adapters
of any rank coexist; those of one shape run together as a few large kernels over the rows sorted
by adapter: a batched matmul over a view when the adapters' slices are equally long, a grouped
matmul (``grouped_matmul.py``) over ragged slices on CUDA, a batched matmul over
padded slices elsewhere. Inside ``Router.stacking()`` (one trainer call) the adapters' stacked
weights are built once and their gradients handed back to each adapter's own parameters at the
end. LoRA math runs in the activations' dtype (``Router.math_dtype``), adapters and their
gradients stay float32."""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from temper.services.lora import deterministic, deterministic_lora, grouped_matmul


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
    plans: dict = field(default_factory=dict)    # present adapter keys -> their buckets (_bucket_shapes)
    offsets: dict = field(default_factory=dict)  # grouped_mm token offsets per bucket of segments
    batch_rows: int = 0                          # rows of the model's input (LoraModel's embedding hook)
    slots: dict = field(default_factory=dict)    # (tokens, batch_rows) -> each flat token's group (token_slots)

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


    def token_slots(self, tokens: int, device) -> torch.Tensor:
        """Each of ``tokens`` flattened (row, position) tokens' group index, -1 for rows of no group:
        for layers that see the batch as one (tokens, hidden) matrix (routed experts)."""
        key = (tokens, self.batch_rows)
        slots = self.slots.get(key)
        if slots is not None:
            return slots
        if len(self.groups) == 1 and self.groups[0][1] is None:
            slots = torch.zeros(tokens, dtype=torch.long, device=device)
        else:
            rows = self.batch_rows
            if rows <= 0 or tokens % rows:
                raise RuntimeError(f"{tokens} tokens do not split into the {rows} rows of the routed batch")
            row_slot = torch.full((rows,), -1, dtype=torch.long, device=device)
            for g, (_key, index) in enumerate(self.groups):
                row_slot[index] = g
            slots = row_slot.repeat_interleave(tokens // rows).to(device)
        self.slots[key] = slots
        return slots

    def plan(self, layer: "MultiLoraLinear") -> list["BucketPlan"]:
        """The buckets of ``layer``'s adapters present in this routing (computed once per set of
        present adapters: every layer adapted by the same adapters shares it)."""
        adapters = layer.adapters
        keys = tuple(key for key, start, stop in self.segments if stop > start and key in adapters)
        shapes = self.plans.get(keys)
        if shapes is None:
            shapes = self.plans[keys] = _bucket_shapes([(key, start, stop) for key, start, stop in self.segments
                                                        if stop > start and key in adapters], adapters)
        plans = []
        for keys, bounds, scale, dropout, width, adjacent, contiguous in shapes:
            members = [adapters[k] for k in keys]
            single = (members[0], *bounds[0]) if len(members) == 1 else None
            plans.append(BucketPlan(keys, members, bounds, scale, dropout, width, adjacent, contiguous, single))
        return plans

    def token_offsets(self, bounds: tuple, tokens_per_row: int, device) -> torch.Tensor:
        """grouped_mm's int32 end offsets of each slice, in tokens from the first slice's start."""
        key = (bounds, tokens_per_row)
        offsets = self.offsets.get(key)
        if offsets is None:
            first = bounds[0][0]
            offsets = self.offsets[key] = torch.tensor([(stop - first) * tokens_per_row for _, stop in bounds],
                                                       dtype=torch.int32, device=device)
        return offsets


def _bucket_shapes(present: list[tuple[str, int, int]], adapters: dict) -> list[tuple]:
    """Group the present (key, start, stop) slices by (rank, scale, dropout): per bucket (keys,
    bounds, scale, dropout, width, adjacent, contiguous)."""
    buckets: dict[tuple, list[tuple[str, int, int]]] = {}
    for key, start, stop in present:
        w = adapters[key]
        buckets.setdefault((w.rank, w.scale, w.dropout), []).append((key, start, stop))
    shapes = []
    for (_rank, scale, dropout), members in buckets.items():
        keys = tuple(key for key, _, _ in members)
        bounds = tuple((start, stop) for _, start, stop in members)
        width = max(stop - start for start, stop in bounds)
        contiguous = all(bounds[g][1] == bounds[g + 1][0] for g in range(len(bounds) - 1))
        adjacent = contiguous and all(stop - start == width for start, stop in bounds)
        shapes.append((keys, bounds, scale, dropout, width, adjacent, contiguous))
    return shapes


class StackedWeights:
    """The stacked A and B of a fixed list of adapters, built once per ``Router.stacking()`` scope as
    float32 leaves; their gradients are added to each adapter's own parameters when the scope ends."""

    def __init__(self, members: list["LoraWeights"]):
        self.members = members
        grad = any(w.lora_A.requires_grad or w.lora_B.requires_grad for w in members)
        with torch.no_grad():
            self.lora_a = torch.stack([w.lora_A for w in members]).requires_grad_(grad)   # (G, r, in)
            self.lora_b = torch.stack([w.lora_B for w in members]).requires_grad_(grad)   # (G, out, r)


class Router:
    """Shared by every MultiLoraLinear of a model; holds the routing of the pass in progress, the
    dtype of LoRA math, and the stacked weights of the current ``stacking()`` scope."""

    def __init__(self, math_dtype: str = "activation"):
        self._local = threading.local()
        # "activation": LoRA matmuls in the activations' dtype (bf16 on a bf16 base), "float32":
        # always float32 (the adapters' own dtype). Gradients reach the float32 adapters either way.
        self.math_dtype = math_dtype
        # (id(layer), adapter keys) -> StackedWeights while a stacking() scope is open; None outside
        self.stacks: dict[tuple, StackedWeights] | None = None

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

    @contextlib.contextmanager
    def stacking(self):
        """Within the scope (forward and backward passes, no weight changes), adapters sharing a
        batched matmul use stacked weights built once; at its end their gradients are added to
        each adapter's parameters (one foreach add and copy for all). An exception drops them."""
        if self.stacks is not None:  # nested: the outer scope hands the gradients back
            yield
            return
        self.stacks = {}
        try:
            yield
            stacks = self.stacks
        finally:
            self.stacks = None
        _hand_back_gradients(stacks.values())

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.math_dtype == "activation" and x.dtype in (torch.bfloat16, torch.float16):
            return x.dtype
        return torch.float32


def _hand_back_gradients(stacks) -> None:
    add_to, add, fresh_to, fresh = [], [], [], []
    for stacked in stacks:
        for leaf, params in ((stacked.lora_a, [w.lora_A for w in stacked.members]),
                             (stacked.lora_b, [w.lora_B for w in stacked.members])):
            if leaf.grad is None:
                continue
            for p, g in zip(params, leaf.grad.unbind(0)):
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                    fresh_to.append(p.grad)
                    fresh.append(g)
                else:
                    add_to.append(p.grad)
                    add.append(g)
    if fresh:
        torch._foreach_copy_(fresh_to, fresh)
    if add:
        torch._foreach_add_(add_to, add)


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

    def delta(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = x.to(dtype)
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, training=True)
        return (x @ self.lora_A.to(dtype).t()) @ self.lora_B.to(dtype).t() * self.scale


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
        if not x.is_contiguous():
            # a strided 3-D input (the last position of each prompt: logits_to_keep=1) sends the CPU
            # matmul to a batched path that copies the weight once per row (2.4 s for 47 rows of the
            # 49152 x 576 head, against 0.01 s contiguous)
            x = x.contiguous()
        if deterministic.active():  # batch-invariant primitives (services/lora/deterministic.py)
            return deterministic_lora.lora_linear(self, x)
        routing = self.router.current
        rows = routing.batch_rows if routing is not None and self.adapters else 0
        if x.dim() == 2 and 0 < rows != x.shape[0] and x.shape[0] % rows == 0:
            # the model's batch flattened to (tokens, hidden) (Qwen3.5-MoE's shared expert): rows back first
            return self.forward(x.view(rows, -1, x.shape[-1])).flatten(0, 1)
        out = self.base(x)
        if routing is None or not self.adapters:
            return out
        if not routing.prepare(x.shape[0]):  # one adapter for every row
            key = routing.groups[0][0]
            return out + self.adapters[key].delta(x, self.router.compute_dtype(x)).to(out.dtype) if key in self.adapters else out
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

        Adapters with the same rank, scale and dropout run together: as a batched matmul over a
        plain view when their slices are adjacent and equally long (one span for all of them), as a
        grouped matmul over ragged adjacent slices on CUDA, else over slices padded to a common
        length. Many adapters cost a few kernels, not a few each.
        """
        dtype = self.router.compute_dtype(ordered)
        spans = []
        for plan in routing.plan(self):
            if plan.single is not None:
                weights, start, stop = plan.single
                spans.append((start, stop, weights.delta(ordered[start:stop], dtype)))
                continue
            lora_a, lora_b = self._stacked(plan, dtype)              # (G, r, in), (G, out, r)
            bounds, width = plan.bounds, plan.width
            first, last = bounds[0][0], bounds[-1][1]
            if plan.adjacent:  # (G·L, ..., in) rows viewed as (G, L, ..., in)
                padded = ordered[first:last].unflatten(0, (len(bounds), width))
            elif plan.contiguous and _grouped_mm_ok(ordered, dtype, lora_a, lora_b):
                delta = _grouped_delta(ordered[first:last], lora_a, lora_b, plan, routing, dtype)
                if delta is not None:
                    spans.append((first, last, delta))
                    continue
            if not plan.adjacent:
                index = routing.gathers.get(bounds)
                if index is None:
                    pad = ordered.shape[0]  # points at the zero row appended below
                    rows = [list(range(start, stop)) + [pad] * (width - (stop - start)) for start, stop in bounds]
                    index = routing.gathers[bounds] = torch.tensor(rows, device=ordered.device)
                padded = torch.cat([ordered, ordered.new_zeros((1,) + ordered.shape[1:])])[index]  # (G, L, ..., in)
            xs = padded.to(dtype).flatten(1, -2)                      # (G, L·..., in)
            if plan.dropout > 0:
                xs = F.dropout(xs, plan.dropout, training=True)
            batched = torch.bmm(torch.bmm(xs, lora_a.transpose(1, 2)), lora_b.transpose(1, 2)) * plan.scale
            batched = batched.reshape(padded.shape[:-1] + (lora_b.shape[1],))
            if plan.adjacent:
                spans.append((first, last, batched.flatten(0, 1)))
            else:
                spans.extend((start, stop, batched[g, : stop - start]) for g, (start, stop) in enumerate(bounds))
        return sorted(spans, key=lambda span: span[0])

    def _stacked(self, plan: "BucketPlan", dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's stacked A and B in ``dtype``: built once per stacking() scope (gradients
        handed back at its end), else stacked now (gradients flow through the stack)."""
        stacks = self.router.stacks
        if stacks is None:
            lora_a = torch.stack([w.lora_A for w in plan.members])
            lora_b = torch.stack([w.lora_B for w in plan.members])
            return lora_a.to(dtype), lora_b.to(dtype)
        key = (id(self), plan.keys)
        stacked = stacks.get(key)
        if stacked is None:
            stacked = stacks[key] = StackedWeights(plan.members)
        if dtype == torch.float32:
            return stacked.lora_a, stacked.lora_b
        return stacked.lora_a.to(dtype), stacked.lora_b.to(dtype)


@dataclass
class BucketPlan:
    """Adapters of one (rank, scale, dropout) in a layer, for one routing."""

    keys: tuple[str, ...]
    members: list[LoraWeights]
    bounds: tuple[tuple[int, int], ...]     # their (start, stop) slices of the sorted rows
    scale: float
    dropout: float
    width: int = 0                          # longest slice
    adjacent: bool = False                  # equally long and back to back: a view
    contiguous: bool = False                # back to back (ragged): one flat slice
    single: tuple | None = None             # (weights, start, stop) for a bucket of one


def _grouped_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, plan: BucketPlan, routing: Routing,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """The bucket's deltas over its back-to-back ragged slices ``x`` as two grouped matmuls over the
    flat tokens (``grouped_matmul.lowrank``); None where grouped_mm refuses."""
    xs = x.to(dtype).flatten(0, -2)                              # (tokens, in), adapter g's rows together
    if plan.dropout > 0:
        xs = F.dropout(xs, plan.dropout, training=True)
    offsets = routing.token_offsets(plan.bounds, x[0].numel() // x.shape[-1], xs.device)
    delta = grouped_matmul.lowrank(xs, lora_a, lora_b, offsets)
    return None if delta is None else (delta * plan.scale).reshape(x.shape[:-1] + (lora_b.shape[1],))


def _grouped_mm_ok(x: torch.Tensor, dtype: torch.dtype, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """grouped_mm where it has kernels (CUDA bf16; CPU when ``grouped_matmul.SETTINGS["dense_cpu"]``), with
    rank, in and out features 16-byte multiples (the rank too, although ``lowrank`` could pad it: dense
    LoRA's grouped path has not been measured on CUDA with a padded rank)."""
    return grouped_matmul.usable(x.device, dtype, lora_a.shape[1], lora_a.shape[2], lora_b.shape[1],
                                 cpu=grouped_matmul.SETTINGS["dense_cpu"])
