"""Mixture-of-experts co-batching benchmark: what co-batching tenants' LoRA adapters costs and gains
when the adapters reach into the routed experts (CPU, one torch thread).

Model: services/models/tiny.py's ``qwen3_moe`` family built from code into a temporary folder, by
default hidden 256, 4 layers, 8 routed experts top-2, moe_intermediate 128 (hidden / 2), 4 heads /
2 kv heads (head_dim 64), vocab 512. Tenants: 8 adapters tenant-0..7, rank 8, alpha 32, attention +
MLP targets as the trainer resolves them for this model (``LoraModel.group_targets(attn=True,
mlp=True)``: q/k/v/o and both routed-expert projections, expert rank = rank // top_k = 4).

Every timing is the trainer's real cycle path in process, without gRPC: the items decoded as the
trainer's servicer does (``convert.cycle_from_pb``), then ``TrainerEngine.run_cycle`` with the
trainer's default settings, under the trainer's allocator settings. One sample of a variant is its
forward_backward cycle(s) followed by its optim_step cycle(s), timed apart; the tokens are the same
in every variant (8 rows x --tokens, one row per tenant):

  cobatched       one cycle of the 8 tenants' forward_backward items, then one cycle of their 8 optim steps
  single_adapter  one cycle of one item holding the same 8 rows, all on tenant-0, then its optim step
  time_sliced     per tenant, a cycle of its item and then a cycle of its optim step (8 + 8 cycles)

  cobatch_overhead = cobatched / single_adapter      goal <= 1.15
  cobatch_gain     = time_sliced / cobatched          goal >= 1.2

The goals are read on the forward_backward cycles (``ratios``, as multitenant.py's); the same
ratios on the whole training step (forward_backward + optim_step cycles, ``ratios_with_optim_step``:
the co-batched step runs 8 adapters' Adam steps where the single-adapter one runs 1) and on process
CPU time are reported next to them.
Repetitions run the variants back to back in a rotating order after a warm-up; medians, with the
spread of the per-repetition ratios (paired: each repetition's variants ran side by side).

--prototype (on unless --no-prototype): the same three variants again, interleaved in the same
repetitions, with ``proposed_routed`` below in place of ``MultiLoraExperts._routed`` (a copy in this
file; services/lora/experts.py is not changed), plus the largest relative gradient difference
between the two implementations on one co-batched pass. --profile (on unless --no-profile):
torch.profiler attribution of a co-batched and a single-adapter forward_backward cycle (medians of
interleaved rounds) to the
pieces of services/lora/experts.py (forward ops by the method they ran in, backward ops by the
forward op that recorded them, Python/dispatch time by method) and to the rest of the model.

    python benchmarks/moe.py                  # ~2-4 minutes on 2 CPU cores
    python benchmarks/moe.py --quick          # 2 reps, one profiled pass

The last stdout line is the result JSON; it is also written to benchmarks/results/moe.json, with a
chart in benchmarks/results/moe.png.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)
from temper.common.host_allocator import TUNED_MALLOC_ENV, reexec_with_tuned_allocator

HERE = Path(__file__).resolve().parent
GOALS = {"cobatch_overhead": ("<=", 1.15), "cobatch_gain": (">=", 1.2)}
VARIANTS = ("cobatched", "single_adapter", "time_sliced")
PROPOSED = "@proposed"  # suffix of the variants run with proposed_routed
MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
EXPERTS_FIELD = {"qwen3_moe": "num_experts", "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts"}
ADAM = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


# ---- model and engine ---------------------------------------------------------------------------


def build_model(folder: Path, args) -> Path:
    """The tiny family's model at --hidden/--layers/--vocab; --experts other than the family's 8
    rebuilds it from the same config with that many routed experts (same seed)."""
    from temper.services.models.tiny import build_tiny_model

    build_tiny_model(folder, vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers, family=args.family)
    if args.experts:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        if getattr(config, EXPERTS_FIELD[args.family]) != args.experts:
            setattr(config, EXPERTS_FIELD[args.family], args.experts)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.save_pretrained(folder)
    return folder


def build_engine(folder: Path, args, checkpoint_dir: Path):
    """A TrainerEngine with the trainer's defaults and --tenants adapters tenant-0.. on attention +
    MLP (routed experts included)."""
    from temper.services.lora.model import AdapterSpec
    from temper.services.models.loading import load_model
    from temper.services.trainer.engine import TrainerEngine
    from temper.services.trainer.settings import TrainerSettings

    loaded = load_model(str(folder), args.device, args.dtype, args.threads)
    settings = TrainerSettings(base_model=str(folder), checkpoint_dir=checkpoint_dir, device=args.device, dtype=args.dtype,
                               num_threads=args.threads)
    engine = TrainerEngine(loaded, settings)
    spec = AdapterSpec(rank=args.rank, alpha=harness.ALPHA, targets=engine.lora.group_targets(attn=True, mlp=True),
                       expert_rank=args.expert_rank)
    for i in range(args.tenants):
        engine.create_adapter(f"tenant-{i}", spec, seed=i)
    return engine


def cycle(engine, forward_backward: list = (), optim_step: list = ()) -> list:
    """One trainer RunCycle in process, as the servicer runs it (decoded and checked, then the engine)."""
    from temper.services.trainer import convert
    from temper.v1 import trainer_pb2

    request = trainer_pb2.CycleRequest(forward_backward=list(forward_backward), optim_step=list(optim_step))
    fb, optim = convert.cycle_from_pb(request, engine.loaded.vocab_size, engine.loaded.max_context_length)
    results, steps = engine.run_cycle(fb, optim)
    for outcome in (*results, *steps):
        if isinstance(outcome, Exception):  # a refused item: the benchmark's input is wrong
            raise outcome
    return results


def optim_item(run_id: str):
    from temper.v1 import trainer_pb2, types_pb2

    return trainer_pb2.OptimStepItem(training_run_id=run_id, adam_params=types_pb2.AdamParams(**ADAM))


def expert_load(engine, sequences) -> dict:
    """Assignments per routed expert in every MoE layer on the benchmark's tokens (the random router
    is not balanced: uneven loads make uneven (expert, adapter) slices)."""
    import numpy as np
    import torch

    counts, hooks = {}, []
    for path, experts in engine.lora.experts.items():
        def hook(module, args, kwargs, _output, path=path):
            index = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and not t.is_floating_point()][0]
            counts[path] = torch.bincount(index.reshape(-1), minlength=module.num_experts).tolist()
        hooks.append(experts.register_forward_hook(hook, with_kwargs=True))
    try:
        ids = torch.from_numpy(np.stack([s[:-1] for s in sequences])).to(engine.device)
        with torch.no_grad():
            engine.loaded.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {"per_layer": counts, "min": min(min(c) for c in counts.values()), "max": max(max(c) for c in counts.values())}


# ---- the proposed MultiLoraExperts._routed (a copy; services/lora/experts.py is unchanged) -------


def proposed_routed(self, hidden, top_k_index, top_k_weights, slots, keys):
    """MultiLoraExperts._routed without the (expert, adapter) pairs.

    The frozen experts run as before, on the assignments sorted by expert (not by adapter: they do
    not care). The LoRA deltas are computed in assignment order (token-major, where the trainer's
    rows of one adapter are consecutive): per run of consecutive tokens of one adapter, low = x A^T
    over all E experts at once (one (rows, E*r) matmul), a one-hot expert mask (the adapter's scale
    folded in) keeps each assignment's own expert's r columns, and one matmul with B over the (r, E)
    columns gives every assignment's delta (the other experts' zeros contribute nothing, and get no
    gradient). gate_up's A side runs once per token, not once per assignment. Two matmuls per
    (projection, adapter) instead of padded batched matmuls over G = experts x adapters slices,
    with no padded gather, no index building in Python and no zeros + index_add per bucket; the
    output is the top-k weighted sum in assignment order instead of an index_add. Costs E x the LoRA
    FLOPs of the pair path: negligible while E * r is small next to the projections' widths (CPU,
    tiny models); the CUDA grouped_mm path of services/lora/experts.py should stay as it is.
    """
    import torch
    import torch.nn.functional as F

    experts, top_k, tokens = self.num_experts, top_k_index.shape[-1], hidden.shape[0]
    adapters = [self.adapters.get(key) for key in keys]
    values, lengths = torch.unique_consecutive(slots, return_counts=True)
    runs = [(adapters[s] if s >= 0 else None, n) for s, n in zip(values.tolist(), lengths.tolist())]
    flat_expert = top_k_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)                       # assignments by expert
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat_expert, minlength=experts).tolist()
    dtype = self.router.compute_dtype(hidden)
    mask = F.one_hot(flat_expert, experts).to(dtype)                      # (T*k, E), assignment order
    x = hidden.index_select(0, order // top_k)
    gate_up = _proposed_base(self, x, "gate_up", counts).index_select(0, inverse)   # assignment order
    gate_up = gate_up + _proposed_delta(hidden, "gate_up", runs, mask, True, top_k, dtype, gate_up.shape[1]).to(gate_up.dtype)
    act = self.layout.glu(self.base, gate_up)
    down = _proposed_base(self, act.index_select(0, order), "down", counts).index_select(0, inverse)
    down = down + _proposed_delta(act, "down", runs, mask, False, top_k, dtype, down.shape[1]).to(down.dtype)
    return (down.view(tokens, top_k, -1) * top_k_weights[..., None].to(down.dtype)).sum(1).to(hidden.dtype)


def _proposed_base(self, x, projection: str, counts: list[int]):
    """The frozen experts' projection of the expert-sorted rows ``x`` (as _projection, without LoRA)."""
    import torch
    import torch.nn.functional as F

    layout = self.layout
    weight = getattr(self.base, layout.gate_up if projection == "gate_up" else layout.down)
    bias_name = layout.gate_up_bias if projection == "gate_up" else layout.down_bias
    bias = getattr(self.base, bias_name) if bias_name else None
    pieces = []
    for expert, rows in enumerate(x.split(counts)):
        if rows.shape[0]:
            y = rows @ weight[expert] if layout.transposed else F.linear(rows, weight[expert])
            pieces.append(y + bias[expert] if bias is not None else y)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _proposed_delta(x, projection: str, runs, mask, per_token: bool, top_k: int, dtype, fan_out: int):
    """Every adapter's delta of ``projection``, (T*k, out) in assignment order. ``x``: one row per
    token (``per_token``: the hidden states; each token's low-rank row serves its k assignments) or
    one per assignment (the GLU output). peft's layout: A (E*r, in) holds expert e's A in rows
    e*r..(e+1)*r, B (out, r*E) its B in columns e, E+e, ...: low viewed (rows, E, r) and transposed
    to (rows, r, E) lines up with B's columns, so B.t() applies as it is. Runs of equally many tokens
    of adapters of one rank and scale, back to back (the trainer's co-batched rows of equal length):
    two batched matmuls for all of them; otherwise two matmuls per run."""
    import torch

    experts = mask.shape[-1]
    per_row = 1 if per_token else top_k
    members = [weights for weights, _ in runs]
    n = runs[0][1]
    if (len(runs) > 1 and all(w is not None for w in members) and all(m == n for _, m in runs)
            and len({(w.rank, w.scale) for w in members}) == 1):
        g, r, scale = len(members), members[0].rank, members[0].scale
        a = torch.stack([getattr(w, f"{projection}_A") for w in members]).to(dtype)     # (G, E*r, in)
        b = torch.stack([getattr(w, f"{projection}_B") for w in members]).to(dtype)     # (G, out, r*E)
        low = torch.bmm(x.to(dtype).view(g, n * per_row, -1), a.transpose(1, 2)).view(g, n * per_row, experts, r).transpose(2, 3)
        m = (mask * scale).view(g, n, top_k, 1, experts)
        z = low[:, :, None] * m if per_token else low * m.view(g, n * top_k, 1, experts)
        return torch.bmm(z.reshape(g, n * top_k, r * experts), b.transpose(1, 2)).flatten(0, 1)
    pieces = []
    # split, not slicing: its backward is one cat, where each slice's backward would be a full-size zeros + copy
    for (weights, n), rows, m in zip(runs, x.split([n * per_row for _, n in runs]), mask.split([n * top_k for _, n in runs])):
        if weights is None:  # tokens of no adapter of this layer
            pieces.append(x.new_zeros(n * top_k, fan_out, dtype=dtype))
            continue
        a, b, r = getattr(weights, f"{projection}_A"), getattr(weights, f"{projection}_B"), weights.rank
        low = torch.mm(rows.to(dtype), a.to(dtype).t()).view(-1, experts, r).transpose(1, 2)   # (rows, r, E)
        m = m * weights.scale                                             # no grad: the scale costs nothing here
        z = low[:, None] * m.view(n, top_k, 1, experts) if per_token else low * m.view(-1, 1, experts)
        pieces.append(torch.mm(z.reshape(n * top_k, r * experts), b.to(dtype).t()))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


@contextlib.contextmanager
def implementation(proposed: bool):
    """MultiLoraExperts._routed as it is, or proposed_routed, for the duration of the block."""
    from temper.services.lora.experts import MultiLoraExperts

    saved = MultiLoraExperts.__dict__["_routed"]
    if proposed:
        MultiLoraExperts._routed = proposed_routed
    try:
        yield
    finally:
        MultiLoraExperts._routed = saved


def gradient_check(engine, items) -> dict:
    """One co-batched forward_backward with each implementation from the same weights: the largest
    relative difference of any adapter's gradient and of the losses."""
    import torch

    params = {(key, name): p for key, adapter in engine.lora.adapters.items() for name, p in adapter.params.items()}
    saved = {k: None if p.grad is None else p.grad.clone() for k, p in params.items()}
    grads, losses = {}, {}
    for proposed in (False, True):
        for p in params.values():
            p.grad = None
        with implementation(proposed):
            results = cycle(engine, items)
        losses[proposed] = [r.metrics["loss:sum"] for r in results]
        grads[proposed] = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
    for k, p in params.items():
        p.grad = saved[k]
    expert_keys = [k for k in grads[False] if ".experts." in k[1]]
    rel = {k: float((grads[True][k] - grads[False][k]).norm() / grads[False][k].norm().clamp_min(1e-30)) for k in grads[False]}
    return {"same_parameters_with_gradients": set(grads[True]) == set(grads[False]),
            "max_relative_grad_error": max(rel.values()),
            "max_relative_grad_error_experts": max(rel[k] for k in expert_keys) if expert_keys else None,
            "max_abs_loss_difference": max(abs(a - b) for a, b in zip(losses[True], losses[False])),
            "expert_grad_norm": float(torch.stack([grads[False][k].norm() for k in expert_keys]).norm()) if expert_keys else None}


# ---- profile: where a pass's time goes ------------------------------------------------------------

PROFILE_LABELS = {  # record_function range -> piece; the experts.py ones that exist in this checkout are wrapped
    "experts._routed": "experts.py _routed: sort, gather, GLU, index_add",
    "experts._Plan": "experts.py _Plan (slices, buckets)",
    "experts._Bucket": "experts.py _Bucket: index tensors",
    "experts._projection": "experts.py _projection: LoRA factor stacks, index_add, cat",
    "experts._projection.base": "frozen expert matmuls",
    "experts._lora_delta": "experts.py _lora_delta: factor stacks, row index, index_add",
    "experts._pair_deltas": "experts.py padded gather + bmm (_pair_deltas / _Bucket.deltas)",
    "proposed.routed": "proposed: sort, gather, GLU, weighted sum",
    "proposed.base": "proposed: sort, gather, GLU, weighted sum",
    "proposed.delta": "proposed: masked LoRA deltas",
}
# forward ops run directly in _projection that are the frozen experts' matmuls (the rest there is LoRA glue)
BASE_MATMULS = ("aten::linear", "aten::matmul", "aten::mm", "aten::addmm")
EVALUATE = "autograd::engine::evaluate_function"
REST = "rest of the pass (attention + LoRA, norms, router, head, loss)"


@contextlib.contextmanager
def labelled():
    """Wrap the pieces of services/lora/experts.py (those this checkout has) and of the proposal in
    record_function ranges."""
    from torch.profiler import record_function

    from temper.services.lora import experts as module

    def wrap(fn, label):
        def run(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return run

    me = sys.modules[__name__]
    candidates = [(module.MultiLoraExperts, "_routed", "experts._routed"),
                  (module.MultiLoraExperts, "_projection", "experts._projection"),
                  (module.MultiLoraExperts, "_lora_delta", "experts._lora_delta"),
                  (module, "_pair_deltas", "experts._pair_deltas"),
                  (getattr(module, "_Bucket", None), "__init__", "experts._Bucket"),
                  (getattr(module, "_Bucket", None), "deltas", "experts._pair_deltas"),
                  (getattr(module, "_Plan", None), "__init__", "experts._Plan"),
                  (getattr(module, "_Plan", None), "buckets", "experts._Plan"),
                  (me, "proposed_routed", "proposed.routed"), (me, "_proposed_base", "proposed.base"),
                  (me, "_proposed_delta", "proposed.delta")]
    patches = [(owner, name, owner.__dict__[name], label) for owner, name, label in candidates
               if owner is not None and name in owner.__dict__]
    for owner, name, fn, label in patches:
        setattr(owner, name, wrap(fn, label))
    try:
        yield
    finally:
        for owner, name, fn, _ in patches:
            setattr(owner, name, fn)


def attribute(events) -> dict:
    """Self CPU time of every profiled event by the piece it belongs to: a forward op to the
    innermost labelled range it ran in (the frozen experts' matmul ops apart from the glue around
    them, in _projection and in the proposal alike), a backward op to the piece of the forward op
    that recorded its autograd node (matching sequence numbers), a labelled range's own time
    (Python, dispatch) to ``python_ms``. Milliseconds."""
    def owner(event):
        node, top = event, event
        while node is not None:
            if node.name.startswith(EVALUATE):
                return "backward", node
            if node is not event and node.name in PROFILE_LABELS:
                if node.name in ("experts._projection", "proposed.base") and top.name in BASE_MATMULS:
                    return "forward", "experts._projection.base"
                if node.name == "proposed.base":  # the split and cat around the matmuls: glue, as in _projection
                    return "forward", "proposed.routed"
                return "forward", node.name
            top, node = node, node.cpu_parent
        return "forward", None

    events = sorted(events, key=lambda e: e.time_range.start)
    forward_label = {}
    for event in events:
        kind, label = owner(event)
        if kind == "forward" and event.sequence_nr >= 0 and event.name not in PROFILE_LABELS:
            # the last op recorded with a sequence number created the node: ops before it may show the same
            # number without creating one (weight[e] of a frozen weight, taken just before F.linear)
            forward_label[(event.thread, event.sequence_nr)] = label
    out = defaultdict(lambda: {"forward_ms": 0.0, "backward_ms": 0.0, "python_ms": 0.0})
    for event in events:
        ms = event.self_cpu_time_total / 1e3
        if event.name in PROFILE_LABELS:
            out[event.name]["python_ms"] += ms
            continue
        kind, label = owner(event)
        if kind == "backward":  # label: the evaluate_function event of the node this op ran for
            thread = getattr(label, "fwd_thread", None) or label.thread
            out[forward_label.get((thread, label.sequence_nr)) or "rest"]["backward_ms"] += ms
        else:
            out[label or "rest"]["forward_ms"] += ms
    return out


def profile(engine, runs: dict, rounds: int) -> dict:
    """torch.profiler over one forward_backward cycle of each of ``runs`` (name -> (fn, proposed)),
    ``rounds`` times in a rotating order; per piece the median over rounds (the profiler measures
    wall time: on a shared machine one round may be descheduled, the median is not)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    names = list(runs)
    per_round = {name: [] for name in names}
    top_ops = {name: defaultdict(list) for name in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[: k % len(names)]:
            fn, proposed = runs[name]
            with labelled(), implementation(proposed):  # labelled first: implementation installs the wrapped proposal
                fn()  # the wrappers' first call outside the measurement
                with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                    fn()
            per_round[name].append(attribute(prof.events()))
            for e in prof.key_averages():
                top_ops[name][e.key].append((e.self_cpu_time_total / 1e3, e.count))
    out = {}
    for name in names:
        labels = dict.fromkeys(label for pieces in per_round[name] for label in pieces)
        table = {}
        for label in labels:
            times = {kind: median([pieces.get(label, {}).get(kind, 0.0) for pieces in per_round[name]])
                     for kind in ("forward_ms", "backward_ms", "python_ms")}
            row = table.setdefault(PROFILE_LABELS.get(label, REST), {"forward_ms": 0.0, "backward_ms": 0.0, "python_ms": 0.0})
            for kind, ms in times.items():
                row[kind] += ms
        for row in table.values():
            row["total_ms"] = row["forward_ms"] + row["backward_ms"] + row["python_ms"]
        total = sum(v["total_ms"] for v in table.values())
        for v in table.values():
            v["fraction"] = v["total_ms"] / total if total else 0.0
        ops = sorted(((op, median([t for t, _ in xs]), xs[0][1]) for op, xs in top_ops[name].items()), key=lambda o: -o[1])
        out[name] = {"pieces": dict(sorted(table.items(), key=lambda kv: -kv[1]["total_ms"])), "total_ms": total,
                     "rounds": rounds, "experts_fraction": sum(v["fraction"] for k, v in table.items() if k != REST),
                     "top_ops": [{"op": op, "self_ms": ms, "calls": calls} for op, ms, calls in ops[:12]]}
    return out


# ---- results ------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"min": min(xs), "q1": q[0], "median": median(xs), "q3": q[2], "max": max(xs), "per_rep": xs}


def verdict(name: str, value: float) -> bool:
    op, goal = GOALS[name]
    return value <= goal if op == "<=" else value >= goal


def ratios_of(samples: dict, suffix: str, kind: str) -> tuple[dict, dict]:
    """(median ratios, their spread over repetitions) of the variants with ``suffix`` on ``kind``
    (forward_backward, cycle = forward_backward + optim_step, cpu_forward_backward, cpu_cycle)."""
    def series(variant):
        s = samples[variant + suffix]
        if kind == "cycle":
            return [a + b for a, b in zip(s["forward_backward"], s["optim_step"])]
        return s[kind]

    co, single, sliced = series("cobatched"), series("single_adapter"), series("time_sliced")
    ratios = {"cobatch_overhead": median(co) / median(single), "cobatch_gain": median(sliced) / median(co)}
    per_rep = {"cobatch_overhead": spread([c / s for c, s in zip(co, single)]),
               "cobatch_gain": spread([t / c for t, c in zip(sliced, co)])}
    return ratios, per_rep


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiled = result.get("profile")
    fig, axes = plt.subplots(1, 2 if profiled else 1, figsize=(12 if profiled else 6, 5.2), dpi=90, squeeze=False)
    ax = axes[0][0]
    sets = [("current experts.py", result["ratios"], result["spread"], "#2f6db5")]
    if result.get("proposed"):
        sets.append(("proposed _routed", result["proposed"]["ratios"], result["proposed"]["spread"], "#3a923a"))
    width = 0.8 / len(sets)
    for j, (label, ratios, spreads, color) in enumerate(sets):
        for i, name in enumerate(GOALS):
            x = i + (j - (len(sets) - 1) / 2) * width
            s = spreads[name]
            ax.bar(x, ratios[name], width * 0.9, color=color, label=label if i == 0 else None,
                   yerr=[[max(0.0, ratios[name] - s["min"])], [max(0.0, s["max"] - ratios[name])]], capsize=3)
            ax.text(x, ratios[name] / 2, f"{ratios[name]:.2f}", ha="center", va="center", color="white", fontsize=9,
                    fontweight="bold")
    for i, name in enumerate(GOALS):
        op, goal = GOALS[name]
        ax.hlines(goal, i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.3)
        ax.text(i + 0.45, goal, f"goal {op} {goal:g}", ha="right", va="bottom", fontsize=7)
    ticks = [f"{n}\n{'co/single' if n == 'cobatch_overhead' else 'sliced/co'}" for n in GOALS]
    ax.set_xticks(range(len(GOALS)), ticks, fontsize=8)
    ax.set_ylabel("ratio of median forward_backward cycle times\n(error bars: min-max of per-rep ratios)", fontsize=8)
    ax.legend(fontsize=8, loc="upper left")
    c = result["config"]
    ax.set_title(f"MoE co-batching: {c['family']} h{c['hidden']} L{c['layers']} E{c['experts']} top{c['top_k']}, "
                 f"{c['tenants']} tenants x {c['tokens_per_row']} tok, {c['threads']} thread", fontsize=8)
    if profiled:
        ax = axes[0][1]
        names = list(profiled)
        labels = list(dict.fromkeys(label for name in names for label in profiled[name]["pieces"]))
        colors = plt.cm.tab10.colors
        bottoms = [0.0] * len(names)
        for k, label in enumerate(labels):
            values = [profiled[name]["pieces"].get(label, {}).get("total_ms", 0.0) for name in names]
            ax.bar(range(len(names)), values, 0.6, bottom=bottoms, color=colors[k % len(colors)], label=label)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set_xticks(range(len(names)), [n.replace(PROPOSED, "\n(proposed)") for n in names], fontsize=8)
        ax.set_ylabel("profiled CPU ms per forward_backward cycle")
        ax.set_title("where a pass's time goes (torch.profiler, fwd + bwd + Python)", fontsize=8)
        ax.set_ylim(0, max(bottoms) * 1.05)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    if profiled:
        fig.subplots_adjust(bottom=0.3)  # room for the pieces' legend below the right panel
    fig.savefig(path)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=MOE_FAMILIES, default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (moe_intermediate is hidden / 2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=0, help="routed experts (default: the tiny family's 8)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per tenant (one row each)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--expert-rank", type=int, default=0,
                        help="routed experts' rank (0: rank // top_k, the trainer's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: timings stable on a shared machine)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 15, --quick 2)")
    parser.add_argument("--quick", action="store_true", help="2 repetitions, one profiled pass per variant")
    parser.add_argument("--no-prototype", action="store_true", help="skip the proposed _routed's variants")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler attribution")
    parser.add_argument("--default-allocator", action="store_true", help="time under glibc's default malloc settings")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    reexec_with_tuned_allocator(not args.default_allocator)  # the trainer process's allocator settings

    import torch
    from tqdm import tqdm

    reps = args.reps or (2 if args.quick else 15)
    profile_rounds = 1 if args.quick else 5
    suffixes = [""] + ([] if args.no_prototype else [PROPOSED])
    names = [v + s for s in suffixes for v in VARIANTS]
    started = time.perf_counter()
    steps = 2 + len(names) * (1 + reps) + (0 if args.no_profile else 2 * len(suffixes) * profile_rounds)
    progress = tqdm(total=steps, desc="moe", unit="step", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="temper-moe-") as tmp:
        progress.set_postfix_str("building the model and engine")
        folder = build_model(Path(tmp) / "model", args)
        engine = build_engine(folder, args, Path(tmp) / "ckpt")
        torch.set_num_threads(args.threads)
        config = engine.loaded.model.config
        spec = engine.lora.adapters["tenant-0"].spec
        sequences = harness.random_sequences(args.tenants, args.tokens, engine.loaded.vocab_size, seed=0)
        protos = [harness.datum_proto(s) for s in sequences]
        keys = [f"tenant-{i}" for i in range(args.tenants)]
        cobatched_items = [harness.fb_item(key, [d]) for key, d in zip(keys, protos)]
        single_items = [harness.fb_item(keys[0], protos)]
        load = expert_load(engine, sequences)
        progress.update()

        def step(kind: str, forward_backward: list = (), optim_step: list = ()):
            return kind, lambda: cycle(engine, forward_backward, optim_step)

        plans = {  # variant -> its cycles in order: ("fb" | "optim", run)
            "cobatched": [step("fb", cobatched_items), step("optim", optim_step=[optim_item(k) for k in keys])],
            "single_adapter": [step("fb", single_items), step("optim", optim_step=[optim_item(keys[0])])],
            "time_sliced": [s for key, item in zip(keys, cobatched_items)
                            for s in (step("fb", [item]), step("optim", optim_step=[optim_item(key)]))],
        }
        samples = {n: {"forward_backward": [], "optim_step": [], "cpu_cycle": [], "cpu_forward_backward": []} for n in names}

        def timed(name: str, record: bool) -> None:
            variant, proposed = name.removesuffix(PROPOSED), name.endswith(PROPOSED)
            wall = {"fb": 0.0, "optim": 0.0}
            cpu = {"fb": 0.0, "optim": 0.0}
            with implementation(proposed):
                for kind, fn in plans[variant]:
                    start, cpu_start = time.perf_counter(), time.process_time()
                    fn()
                    harness.sync(args.device)
                    wall[kind] += time.perf_counter() - start
                    cpu[kind] += time.process_time() - cpu_start
            if record:
                s = samples[name]
                s["forward_backward"].append(wall["fb"])
                s["optim_step"].append(wall["optim"])
                s["cpu_forward_backward"].append(cpu["fb"])
                s["cpu_cycle"].append(cpu["fb"] + cpu["optim"])

        # Warm-up: one of each (one-off allocations, the adapters' .grad and Adam buffers), then the
        # gradient check of the proposal on weights that one optim step has moved off B = 0.
        for name in names:
            progress.set_postfix_str(f"warm-up: {name}")
            timed(name, record=False)
            progress.update()
        progress.set_postfix_str("gradient check")
        check = None if args.no_prototype else gradient_check(engine, cobatched_items)
        progress.update()
        for rep in range(reps):
            order = names[rep % len(names):] + names[: rep % len(names)]  # rotate: no fixed position
            for name in order:
                progress.set_postfix_str(f"rep {rep + 1}/{reps}: {name}")
                timed(name, record=True)
                progress.update()
            tqdm.write(f"rep {rep + 1}: " + ", ".join(
                f"{n} {samples[n]['forward_backward'][-1] + samples[n]['optim_step'][-1]:.3f}s" for n in names))

        profiled = None
        if not args.no_profile:
            runs = {}
            for suffix in suffixes:
                runs["cobatched" + suffix] = (lambda: cycle(engine, cobatched_items), bool(suffix))
                runs["single_adapter" + suffix] = (lambda: cycle(engine, single_items), bool(suffix))
            progress.set_postfix_str("profile")
            profiled = profile(engine, runs, profile_rounds)
            progress.update(len(runs) * profile_rounds)
        progress.close()

    med = {n: {"forward_backward": median(s["forward_backward"]), "optim_step": median(s["optim_step"]),
               "cycle": median([a + b for a, b in zip(s["forward_backward"], s["optim_step"])]),
               "cpu_forward_backward": median(s["cpu_forward_backward"]), "cpu_cycle": median(s["cpu_cycle"])}
           for n, s in samples.items()}

    def figures(suffix: str) -> dict:
        ratios, per_rep = ratios_of(samples, suffix, "forward_backward")
        step, step_spread = ratios_of(samples, suffix, "cycle")
        return {"ratios": ratios, "goal_met": {n: verdict(n, v) for n, v in ratios.items()}, "spread": per_rep,
                "ratios_with_optim_step": step, "goal_met_with_optim_step": {n: verdict(n, v) for n, v in step.items()},
                "spread_with_optim_step": step_spread,
                "ratios_cpu_time": ratios_of(samples, suffix, "cpu_forward_backward")[0],
                "goal_met_cpu_time": {n: verdict(n, v) for n, v in ratios_of(samples, suffix, "cpu_forward_backward")[0].items()},
                "ratios_with_optim_step_cpu_time": ratios_of(samples, suffix, "cpu_cycle")[0]}

    current = figures("")
    proposed = None
    if not args.no_prototype:
        proposed = {
            **figures(PROPOSED),
            # median time with the current experts.py / with the proposal, per variant
            "speedup": {v: med[v]["forward_backward"] / med[v + PROPOSED]["forward_backward"] for v in VARIANTS},
            "speedup_cpu_time": {v: med[v]["cpu_forward_backward"] / med[v + PROPOSED]["cpu_forward_backward"] for v in VARIANTS},
            "gradient_check": check,
            "what": "MultiLoraExperts._routed replaced by benchmarks/moe.py:proposed_routed (LoRA deltas in assignment "
                    "order: per adapter run, x A^T over all experts and a one-hot expert mask before B; equal runs of "
                    "one rank as two bmm; no (expert, adapter) pairs, padding or index_add)",
        }
    top_k = int(getattr(config, "num_experts_per_tok"))
    result = {
        "benchmark": "moe",
        **current,
        "goals": {n: f"{op} {g}" for n, (op, g) in GOALS.items()},
        "proposed": proposed,
        "medians_s": med,
        "samples_s": samples,
        "profile": profiled,
        "measures": {
            "cobatch_overhead": "median(cobatched: 1 forward_backward cycle of the tenants' items, one row each) / "
                                "median(single_adapter: 1 forward_backward cycle of one item with the same rows on tenant-0)",
            "cobatch_gain": "median(time_sliced: one forward_backward cycle per tenant) / median(cobatched)",
            "ratios_with_optim_step": "the same on the whole training step: each variant's forward_backward cycle(s) + its "
                                      "optim_step cycle(s) (cobatched: the 8 tenants' steps; single_adapter: 1 step; "
                                      "time_sliced: a step cycle after each tenant's pass)",
            "ratios_cpu_time": "the same on process CPU seconds (user + system)",
            "spread": "per repetition ratios (variants of one repetition ran back to back): min, quartiles, max",
            "profile": "torch.profiler self CPU time per forward_backward cycle: forward ops by enclosing experts.py method, "
                       "backward ops by the forward op that recorded their node, python_ms = the method's own time "
                       "outside ops; profiler overhead inflates small-op code",
        },
        "config": {
            "family": args.family, "model_type": config.model_type, "hidden": args.hidden, "layers": args.layers,
            "experts": int(getattr(config, EXPERTS_FIELD[args.family])), "top_k": top_k,
            "moe_intermediate": int(getattr(config, "moe_intermediate_size", 0) or getattr(config, "intermediate_size", 0)),
            "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads, "vocab": engine.loaded.vocab_size,
            "params": sum(p.numel() for p in engine.loaded.model.parameters()),
            "tenants": args.tenants, "rows_per_tenant": 1, "tokens_per_row": args.tokens, "rank": spec.rank,
            "expert_rank": spec.expert_rank, "alpha": spec.alpha, "targets": list(spec.targets),
            "expert_load": load, "device": args.device, "dtype": args.dtype, "threads": args.threads,
            "threads_note": "one torch thread: stable timings on a shared 2-core machine, CPU time = work done",
            "reps": reps, "quick": args.quick, "adam": ADAM,
            "activation_checkpointing": engine.settings.activation_checkpointing,
            "passes": harness.describe_plan(engine, [args.tokens] * args.tenants),
            "logprob_chunk_tokens": engine.logprob_chunk_tokens, "torch": torch.__version__,
            # which services/lora/experts.py was measured (it changes): the sha1 of its text
            "experts_py_sha1": hashlib.sha1(Path(sys.modules["temper.services.lora.experts"].__file__).read_bytes()).hexdigest(),
            "malloc_env": {k: os.environ.get(k) for k in TUNED_MALLOC_ENV},
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "total_seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "moe.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / "moe.png")
    for label, f in [("current", current)] + ([("proposed", proposed)] if proposed else []):
        for name, value in f["ratios"].items():
            op, goal = GOALS[name]
            sp = f["spread"][name]
            verdicts = {"wall": f["goal_met"][name], "CPU time": f["goal_met_cpu_time"][name],
                        "with optim steps": f["goal_met_with_optim_step"][name]}
            print(f"{label:9s} {name:17s} {value:6.3f} (per rep {sp['min']:.3f}-{sp['max']:.3f}; CPU time "
                  f"{f['ratios_cpu_time'][name]:.3f}; with optim steps {f['ratios_with_optim_step'][name]:.3f})  goal {op} "
                  f"{goal:g}: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in verdicts.items()), file=sys.stderr)
    if proposed:
        speedups = ", ".join(f"{v} {x:.2f}x" for v, x in proposed["speedup"].items())
        print(f"proposed speedup per variant (forward_backward): {speedups}; gradient check {proposed['gradient_check']}",
              file=sys.stderr)
    if profiled:
        for name, prof in profiled.items():
            print(f"profile {name}: {prof['total_ms']:.1f} ms/cycle, experts {prof['experts_fraction']:.0%}: " + "; ".join(
                f"{label} {p['total_ms']:.1f}" for label, p in prof["pieces"].items()), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
