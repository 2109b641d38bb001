"""benchmarks/moe.py's --profile: torch.profiler attribution of a forward_backward cycle to the
pieces of services/lora/experts.py and to the rest of the model.

Forward ops go to the innermost experts.py method they ran in (the frozen experts' matmuls apart
from the LoRA glue around them in ``_projection``), backward ops to the piece of the forward op that
recorded their autograd node, and a method's own time outside ops (Python, dispatch) to its
``python_ms``. Self CPU milliseconds; the profiler's overhead inflates code made of small ops.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

from report import median  # this script's folder is first on sys.path

PIECES = {  # record_function range -> piece of the pass
    "experts._routed": "experts.py _routed: sort, gather, GLU, weighted index_add",
    "experts._Plan": "experts.py _Plan: slices, buckets",
    "experts._Bucket": "experts.py _Bucket.__init__: index tensors",
    "experts._projection": "experts.py _projection: LoRA factor stacks, index_add, cat",
    "experts._projection.base": "frozen expert matmuls",  # not a range: _projection's own matmul ops
    "experts._Bucket.deltas": "experts.py _Bucket.deltas: grouped LoRA matmuls (padded bmm fallback)",
    "experts._Bucket.expert_deltas": "experts.py _Bucket.expert_deltas: small slices, per expert, adapters side by side",
}
WRAPPED = [("MultiLoraExperts", "_routed", "experts._routed"), ("MultiLoraExperts", "_projection", "experts._projection"),
           ("_Plan", "__init__", "experts._Plan"), ("_Plan", "buckets", "experts._Plan"),
           ("_Bucket", "__init__", "experts._Bucket"), ("_Bucket", "deltas", "experts._Bucket.deltas"),
           ("_Bucket", "expert_deltas", "experts._Bucket.expert_deltas")]
BASE_MATMULS = ("aten::linear", "aten::matmul", "aten::mm", "aten::addmm")  # run directly in _projection: frozen experts
EVALUATE = "autograd::engine::evaluate_function"
REST = "rest of the pass (attention + LoRA, norms, router, head, loss)"
KINDS = ("forward_ms", "backward_ms", "python_ms")


@contextlib.contextmanager
def labelled():
    """The methods of services/lora/experts.py in WRAPPED (those this checkout has) wrapped in
    record_function ranges for the duration of the block."""
    from torch.profiler import record_function

    from temper.services.lora import experts as module

    def wrap(fn, label):
        def run(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return run

    patches = [(owner, name, owner.__dict__[name], label) for owner, name, label in
               ((getattr(module, cls, None), name, label) for cls, name, label in WRAPPED)
               if owner is not None and name in owner.__dict__]
    for owner, name, fn, label in patches:
        setattr(owner, name, wrap(fn, label))
    try:
        yield
    finally:
        for owner, name, fn, _ in patches:
            setattr(owner, name, fn)


def attribute(events) -> dict:
    """Self CPU time of every profiled event by the piece it belongs to (the module docstring), in ms."""
    def owner(event):
        node, top = event, event
        while node is not None:
            if node.name.startswith(EVALUATE):
                return "backward", node
            if node is not event and node.name in PIECES:
                if node.name == "experts._projection" and top.name in BASE_MATMULS:
                    return "forward", "experts._projection.base"
                return "forward", node.name
            top, node = node, node.cpu_parent
        return "forward", None

    events = sorted(events, key=lambda e: e.time_range.start)
    forward_label = {}
    for event in events:
        kind, label = owner(event)
        if kind == "forward" and event.sequence_nr >= 0 and event.name not in PIECES:
            # the last op recorded with a sequence number created the node: ops before it may show the same
            # number without creating one (weight[e] of a frozen weight, taken just before F.linear)
            forward_label[(event.thread, event.sequence_nr)] = label
    out = defaultdict(lambda: dict.fromkeys(KINDS, 0.0))
    for event in events:
        ms = event.self_cpu_time_total / 1e3
        if event.name in PIECES:
            out[event.name]["python_ms"] += ms
            continue
        kind, label = owner(event)
        if kind == "backward":  # label: the evaluate_function event of the node this op ran for
            thread = getattr(label, "fwd_thread", None) or label.thread
            out[forward_label.get((thread, label.sequence_nr)) or "rest"]["backward_ms"] += ms
        else:
            out[label or "rest"]["forward_ms"] += ms
    return out


def profile(runs: dict, rounds: int) -> dict:
    """torch.profiler over each of ``runs`` (name -> one forward_backward cycle), ``rounds`` times in
    a rotating order; per piece the median over rounds (the profiler measures wall time: on a shared
    machine one round may be descheduled, the median is not)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    names = list(runs)
    per_round = {name: [] for name in names}
    top_ops = {name: defaultdict(list) for name in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[: k % len(names)]:
            with labelled():
                runs[name]()  # the wrappers' first call outside the measurement
                with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                    runs[name]()
            per_round[name].append(attribute(prof.events()))
            for e in prof.key_averages():
                top_ops[name][e.key].append((e.self_cpu_time_total / 1e3, e.count))
    out = {}
    for name in names:
        table = {}
        for label in dict.fromkeys(label for pieces in per_round[name] for label in pieces):
            row = table.setdefault(PIECES.get(label, REST), dict.fromkeys(KINDS, 0.0))
            for kind in KINDS:
                row[kind] += median([pieces.get(label, {}).get(kind, 0.0) for pieces in per_round[name]])
        for row in table.values():
            row["total_ms"] = sum(row[kind] for kind in KINDS)
        total = sum(v["total_ms"] for v in table.values())
        for v in table.values():
            v["fraction"] = v["total_ms"] / total if total else 0.0
        ops = sorted(((op, median([t for t, _ in xs]), xs[0][1]) for op, xs in top_ops[name].items()), key=lambda o: -o[1])
        out[name] = {"pieces": dict(sorted(table.items(), key=lambda kv: -kv[1]["total_ms"])), "total_ms": total,
                     "rounds": rounds, "experts_fraction": sum(v["fraction"] for k, v in table.items() if k != REST),
                     "top_ops": [{"op": op, "self_ms": ms, "calls": calls} for op, ms, calls in ops[:12]]}
    return out
