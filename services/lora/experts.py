"""LoRA on a mixture-of-experts layer's routed experts, for many adapters in one pass.

transformers 5 keeps a layer's routed experts as two fused 3-D parameters (``gate_up_proj`` and
``down_proj``, one slice per expert). ``MultiLoraExperts`` wraps that module: every adapter gets its
own rank-r pair per expert for each of the two projections, the router stays frozen, and each token's
delta comes from its own adapter's LoRA on the experts the router chose for it:

    gate_up_e(x) = W_e x (+ b_e) + s * B_e A_e x,  then the family's GLU,  then down_e likewise.

The (token, expert) assignments are sorted by expert and, within an expert, by adapter; the frozen
expert weights run once per expert over all its tokens, whatever adapter they belong to, and the
LoRA factors of every (expert, adapter) pair present run together as two grouped matmuls over the
pairs' ragged slices (``grouped_mm``; batched matmuls over padded slices where it has no kernel). No
per-token Python loop; gradients reach only the adapter a token belongs to, and only its experts that
the token was routed to.

An adapter's parameters are peft's ``ParamWrapper`` tensors as they are saved: ``lora_A`` (r·E, in)
holds expert e's A in rows e·r..(e+1)·r, ``lora_B`` (out, r·E) holds expert e's B in columns
e, E+e, 2E+e, ... (peft reshapes (out, r, E)); the per-expert factors are views of them, so a saved
adapter is exactly what vanilla peft loads with ``target_parameters``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from temper.services.lora import grouped_matmul
from temper.services.lora.layer import Router, Routing
from temper.services.models.families import ExpertLayout

PROJECTIONS = ("gate_up", "down")
PAD_SLACK = 1.25  # a chunk of padded LoRA slices: its longest slice at most this many times its shortest
# a bucket of several adapters whose (expert, adapter) slices average at most this many rows runs per
# expert (CPU grouped_mm only): measured on a 2-core CPU, a grouped matmul's per-group cost outweighs
# the adapters-times larger LoRA rank below it
SMALL_SLICE = 48
LOW_WIDTH = 16  # ... and each group takes as many adapters as fill this many low-rank columns


class ExpertLoraWeights(nn.Module):
    """One adapter's LoRA on one layer's routed experts (both projections), in peft's layout."""

    def __init__(self, num_experts: int, shapes: dict[str, tuple[int, int]], rank: int, alpha: float, device,
                 generator=None):
        super().__init__()
        self.num_experts, self.rank, self.alpha = num_experts, rank, alpha
        self.scale = alpha / rank
        self.shapes = shapes  # projection -> (in, out)
        for name, (fan_in, fan_out) in shapes.items():
            a = nn.Parameter(torch.empty(rank * num_experts, fan_in, device=device, dtype=torch.float32))
            b = nn.Parameter(torch.zeros(fan_out, rank * num_experts, device=device, dtype=torch.float32))
            bound = 1.0 / math.sqrt(fan_in)  # peft's kaiming-uniform(a=sqrt(5)) on lora_A; B = 0: a no-op at start
            with torch.no_grad():
                a.uniform_(-bound, bound, generator=generator)
            setattr(self, f"{name}_A", a)
            setattr(self, f"{name}_B", b)

    def factors(self, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's (A (E, r, in), B (E, out, r)) of ``projection``, as views of the parameters."""
        a, b = getattr(self, f"{projection}_A"), getattr(self, f"{projection}_B")
        fan_in, fan_out = self.shapes[projection]
        return a.view(self.num_experts, self.rank, fan_in), b.view(fan_out, self.rank, self.num_experts).permute(2, 0, 1)


class MultiLoraExperts(nn.Module):
    """Wraps a family's fused experts module (``ExpertLayout``); runs it as it is for rows without an
    adapter of this layer, else the routed computation above."""

    def __init__(self, base: nn.Module, layout: ExpertLayout, router: Router):
        super().__init__()
        self.base = base
        self.layout = layout
        self.router = router
        self.adapters: dict[str, ExpertLoraWeights] = {}  # owned by LoraModel
        gate_up, down = getattr(base, layout.gate_up), getattr(base, layout.down)
        self.num_experts = int(gate_up.shape[0])
        # (in, out) of each projection whatever the storage order
        swap = (lambda s: (s[1], s[2])) if layout.transposed else (lambda s: (s[2], s[1]))
        self.shapes = {"gate_up": swap(gate_up.shape), "down": swap(down.shape)}

    def new_weights(self, rank: int, alpha: float, device, generator=None) -> ExpertLoraWeights:
        return ExpertLoraWeights(self.num_experts, self.shapes, rank, alpha, device, generator)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        routing = self.router.current
        if routing is None or not self.adapters:
            return self.base(hidden, top_k_index, top_k_weights)
        keys = [key for key, _ in routing.groups]
        if not any(key in self.adapters for key in keys):
            return self.base(hidden, top_k_index, top_k_weights)
        slots = routing.token_slots(hidden.shape[0], hidden.device)   # (T,) index into ``keys``, -1: no adapter
        return self._routed(hidden, top_k_index, top_k_weights, slots, keys)

    def _routed(self, hidden, top_k_index, top_k_weights, slots, keys) -> torch.Tensor:
        experts, top_k = self.num_experts, top_k_index.shape[-1]
        adapters = [self.adapters.get(key) for key in keys]
        # an assignment's adapter column: 0 for none, 1 + the slot of an adapter this layer has
        column = torch.tensor([0] + [1 + s if w is not None else 0 for s, w in enumerate(adapters)],
                              device=hidden.device)[slots + 1]
        width = len(keys) + 1
        flat_expert = top_k_index.reshape(-1)
        token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(top_k)
        key = flat_expert * width + column.repeat_interleave(top_k)   # (expert, adapter column) of each assignment
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=experts * width).tolist()
        token, weight = token[order], top_k_weights.reshape(-1)[order]
        plan = _Plan(counts, experts, width)
        buckets = [_Bucket(slots, pairs, experts, hidden.shape[0] * top_k, hidden.device, adapters[slots[0]].rank)
                   for slots, pairs in plan.buckets(adapters)]
        x = hidden.index_select(0, token)                                     # (N, hidden), sorted
        gate_up = self._projection(x, "gate_up", plan, buckets, adapters)
        act = self.layout.glu(self.base, gate_up)
        out = self._projection(act, "down", plan, buckets, adapters)
        out = (out * weight[:, None]).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add(0, token, out)

    def _projection(self, x: torch.Tensor, projection: str, plan: "_Plan", buckets: list["_Bucket"],
                    adapters: list) -> torch.Tensor:
        """The frozen experts' projection of the sorted rows ``x``, plus every adapter's LoRA delta."""
        layout = self.layout
        weight = getattr(self.base, layout.gate_up if projection == "gate_up" else layout.down)
        bias_name = layout.gate_up_bias if projection == "gate_up" else layout.down_bias
        bias = getattr(self.base, bias_name) if bias_name else None
        pieces = []
        # split, not slices: the backward pass of a slice allocates a gradient as large as all of x
        for expert, rows in enumerate(x.split([stop - start for start, stop in plan.experts])):
            if rows.shape[0] == 0:
                continue
            y = rows @ weight[expert] if layout.transposed else F.linear(rows, weight[expert])
            pieces.append(y + bias[expert] if bias is not None else y)
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        dtype = self.router.compute_dtype(x)
        xs = x.to(dtype)
        for bucket in buckets:
            if bucket.per_expert and _grouped_usable(xs, *self.shapes[projection]):
                delta = bucket.expert_deltas(xs, [adapters[slot] for slot in bucket.slots], projection)
                if delta is not None:
                    out = out.index_add(0, bucket.rows, delta.to(out.dtype))
                    continue
            # every (adapter, expert) pair's factors of the bucket, stacked once: (slots·E, r, in), (slots·E, out, r)
            factors = [adapters[slot].factors(projection) for slot in bucket.slots]
            lora_a = torch.cat([a for a, _ in factors]).index_select(0, bucket.pair_ids).to(dtype)
            lora_b = torch.cat([b for _, b in factors]).index_select(0, bucket.pair_ids).to(dtype)
            rows, delta = bucket.deltas(xs, lora_a, lora_b, adapters[bucket.slots[0]].scale)
            out = out.index_add(0, rows, delta.to(out.dtype))
        return out


class _Bucket:
    """The (adapter, expert) pairs with rows of adapters of one (rank, scale), and the index tensors
    their LoRA matmuls need, built once per layer call for both projections.

    The pairs' rows, back to back, go through two grouped matmuls (``grouped_mm``: one kernel for all
    pairs, ragged, no padding). Where grouped_mm has no kernel for the dtype (CUDA runs bf16 only; CPU
    float32, bfloat16 and float16), pairs run as batched matmuls over slices padded to a common
    length, taken in chunks of similar length (the longest at most ``PAD_SLACK`` times the shortest)
    so that padding stays a small part of the work however unevenly the router spreads the tokens."""

    def __init__(self, slots: list[int], pairs: list[tuple[int, int, int, int]], experts: int, total: int, device,
                 rank: int):
        self.slots, self.total, self.device = slots, total, device
        position = {slot: k for k, slot in enumerate(slots)}
        self.bounds = [(start, stop) for _, _, start, stop in pairs]
        self.pair_ids = torch.tensor([position[slot] * experts + e for slot, e, _, _ in pairs], device=device)
        self.contiguous = _contiguous(self.bounds)
        lengths = [stop - start for start, stop in self.bounds]
        self.rows = (torch.arange(self.bounds[0][0], self.bounds[-1][1], device=device) if self.contiguous else
                     torch.cat([torch.arange(start, stop) for start, stop in self.bounds]).to(device))
        self.offsets = torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        self.chunks: list[tuple] | None = None  # the padded fallback's, built on first use
        # per expert instead of per pair: each expert's rows of the bucket (back to back in ``rows``) times
        # the factors of ``span`` adapters side by side (one group per expert and span of adapters), the
        # columns of other adapters than a row's own masked
        self.span = span = min(len(slots), LOW_WIDTH // rank)
        self.per_expert = span > 1 and device.type == "cpu" and sum(lengths) <= SMALL_SLICE * len(lengths)
        if self.per_expert:
            self.spans = -(-len(slots) // span)
            groups: dict[int, int] = {}
            for slot, e, start, stop in pairs:
                group = e * self.spans + position[slot] // span
                groups[group] = groups.get(group, 0) + stop - start
            self.group_ids = (None if list(groups) == list(range(experts * self.spans)) else
                              torch.tensor(list(groups), device=device))
            self.group_offsets = torch.tensor(list(groups.values()), dtype=torch.int32).cumsum(
                0, dtype=torch.int32).to(device)
            self.row_slot = torch.tensor([position[slot] % span for slot, _, _, _ in pairs]).repeat_interleave(
                torch.tensor(lengths)).to(device)
            self.masks: dict = {}

    def expert_deltas(self, x: torch.Tensor, weights: list, projection: str) -> torch.Tensor | None:
        """``scale * B A x`` on the bucket's rows (``rows``), one group per expert and span of adapters:
        A (span·r, in) and B (out, span·r) of the span's adapters side by side, each row's low-rank
        activations zero outside its own adapter's r columns (so each adapter's factors get only its own
        rows' gradient)."""
        factors = [w.factors(projection) for w in weights]
        rank, span, spans = weights[0].rank, self.span, self.spans
        lora_a = torch.stack([a for a, _ in factors], 1)     # (E, k, r, in)
        lora_b = torch.stack([b.transpose(1, 2) for _, b in factors], 1)   # (E, k, r, out): B's storage order
        if spans * span != len(weights):
            lora_a = F.pad(lora_a, (0, 0, 0, 0, 0, spans * span - len(weights)))
            lora_b = F.pad(lora_b, (0, 0, 0, 0, 0, spans * span - len(weights)))
        experts = lora_a.shape[0]
        lora_a = lora_a.reshape(experts * spans, span * rank, -1)                  # (E·S, span·r, in)
        lora_b = lora_b.reshape(experts * spans, span * rank, -1).transpose(1, 2)  # (E·S, out, span·r)
        if self.group_ids is not None:
            lora_a, lora_b = lora_a.index_select(0, self.group_ids), lora_b.index_select(0, self.group_ids)
        lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        mask = self.masks.get((rank, x.dtype))
        if mask is None:
            columns = torch.arange(span * rank, device=x.device) // rank
            mask = self.masks[(rank, x.dtype)] = (columns[None, :] == self.row_slot[:, None]).to(x.dtype)
        xs = x[self.bounds[0][0]:self.bounds[-1][1]] if self.contiguous else x.index_select(0, self.rows)
        delta = _grouped_delta(xs, lora_a, lora_b, self.group_offsets, mask)
        return None if delta is None else delta * weights[0].scale

    def deltas(self, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``x`` the bucket's pairs cover and ``scale * B_g A_g x`` on each of them."""
        xs = x[self.bounds[0][0]:self.bounds[-1][1]] if self.contiguous else x.index_select(0, self.rows)
        delta = _grouped_delta(xs, lora_a, lora_b, self.offsets)
        if delta is not None:
            return self.rows, delta * scale
        if self.chunks is None:
            self._build_chunks()
        padded_x = torch.cat([x, x.new_zeros(1, x.shape[1])])
        outs = []
        for members, index, kept in self.chunks:
            a, b = (lora_a, lora_b) if members is None else (lora_a[members], lora_b[members])
            out = torch.bmm(torch.bmm(padded_x[index], a.transpose(1, 2)), b.transpose(1, 2))   # (G, L, out)
            outs.append(out.flatten(0, 1).index_select(0, kept))
        return self.padded_rows, (torch.cat(outs) if len(outs) > 1 else outs[0]) * scale

    def _build_chunks(self) -> None:
        lengths = [stop - start for start, stop in self.bounds]
        self.chunks, rows, chunk = [], [], []
        for g in sorted(range(len(lengths)), key=lambda g: -lengths[g]):
            if chunk and lengths[g] * PAD_SLACK < lengths[chunk[0]]:
                rows.append(self._add_chunk(chunk, lengths))
                chunk = []
            chunk.append(g)
        rows.append(self._add_chunk(chunk, lengths))
        self.padded_rows = torch.cat(rows) if len(rows) > 1 else rows[0]

    def _add_chunk(self, members: list[int], lengths: list[int]) -> torch.Tensor:
        longest = lengths[members[0]]
        index, kept, rows = [], [], []
        for k, g in enumerate(members):
            start, stop = self.bounds[g]
            index.extend(range(start, stop))
            index.extend([self.total] * (longest - (stop - start)))   # ``total``: the zero row appended to x
            kept.extend(range(k * longest, k * longest + stop - start))
            rows.extend(range(start, stop))
        every = members == list(range(len(self.bounds)))  # all pairs in their own order: no factor gather
        self.chunks.append((None if every else torch.tensor(members, device=self.device),
                            torch.tensor(index, device=self.device).view(len(members), longest),
                            torch.tensor(kept, device=self.device)))
        return torch.tensor(rows, device=self.device)


def _grouped_usable(xs: torch.Tensor, fan_in: int, fan_out: int) -> bool:
    """Whether ``_grouped_delta`` has a kernel for these rows and projection shape (the rank is padded)."""
    return grouped_matmul.usable(xs.device, xs.dtype, fan_in, fan_out, cpu=grouped_matmul.SETTINGS["experts_cpu"])


def _grouped_delta(xs: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, offsets: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """``B_g A_g x`` over each group's rows of ``xs`` (``grouped_matmul.lowrank``); None where grouped_mm
    has no kernel."""
    if not _grouped_usable(xs, xs.shape[1], lora_b.shape[1]):
        return None
    return grouped_matmul.lowrank(xs, lora_a, lora_b, offsets, mask)


class _Plan:
    """Where each expert's rows and each (expert, adapter column) slice sit among the sorted rows."""

    def __init__(self, counts: list[int], experts: int, width: int):
        self.width = width
        self.slices: list[tuple[int, int]] = []
        at = 0
        for count in counts:
            self.slices.append((at, at + count))
            at += count
        self.experts = [(self.slices[e * width][0], self.slices[e * width + width - 1][1]) for e in range(experts)]

    def buckets(self, adapters: list) -> list[tuple[list[int], list[tuple[int, int, int, int]]]]:
        """Per (rank, scale) of the adapters: their slots and the (slot, expert, start, stop) slices with rows."""
        out: dict[tuple[int, float], list] = {}
        for e in range(len(self.experts)):
            for column in range(1, self.width):
                start, stop = self.slices[e * self.width + column]
                if stop > start:
                    w = adapters[column - 1]
                    out.setdefault((w.rank, w.scale), []).append((column - 1, e, start, stop))
        return [(sorted({p[0] for p in pairs}), pairs) for pairs in out.values()]


def _contiguous(bounds) -> bool:
    return all(bounds[g][1] == bounds[g + 1][0] for g in range(len(bounds) - 1))
