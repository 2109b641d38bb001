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

--profile (on unless --no-profile): torch.profiler attribution of a co-batched and a single-adapter
forward_backward cycle (medians of interleaved rounds) to the pieces of services/lora/experts.py and
to the rest of the model (benchmarks/moe_profile.py).

    python benchmarks/moe.py                  # under a minute on 2 CPU cores
    python benchmarks/moe.py --quick          # 2 reps, one profiled pass

The last stdout line is the result JSON; it is also written to benchmarks/results/moe.json, with a
chart in benchmarks/results/moe.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)
import moe_profile
import report
from temper.common.host_allocator import TUNED_MALLOC_ENV, reexec_with_tuned_allocator

HERE = Path(__file__).resolve().parent
GOALS = {"cobatch_overhead": ("<=", 1.15), "cobatch_gain": (">=", 1.2)}
VARIANTS = ("cobatched", "single_adapter", "time_sliced")
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


# ---- results ------------------------------------------------------------------------------------


def verdict(name: str, value: float) -> bool:
    return report.goal_met(GOALS[name], value)


def ratios_of(samples: dict, kind: str) -> tuple[dict, dict]:
    """(median ratios, their spread over repetitions) on ``kind`` (forward_backward, cycle =
    forward_backward + optim_step, cpu_forward_backward, cpu_cycle)."""
    def series(variant):
        s = samples[variant]
        if kind == "cycle":
            return [a + b for a, b in zip(s["forward_backward"], s["optim_step"])]
        return s[kind]

    ratios, per_rep = report.cobatch_ratios(series("cobatched"), series("single_adapter"), series("time_sliced"))
    return ratios, {name: report.spread(xs) for name, xs in per_rep.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiled = result.get("profile")
    fig, axes = plt.subplots(1, 2 if profiled else 1, figsize=(12 if profiled else 6, 5.2), dpi=90, squeeze=False)
    ax = axes[0][0]
    ratios, spreads = result["ratios"], result["spread"]
    for i, name in enumerate(GOALS):
        s, op, goal = spreads[name], *GOALS[name]
        ax.bar(i, ratios[name], 0.6, color="#2f6db5",
               yerr=[[max(0.0, ratios[name] - s["min"])], [max(0.0, s["max"] - ratios[name])]], capsize=3)
        ax.text(i, ratios[name] / 2, f"{ratios[name]:.2f}", ha="center", va="center", color="white", fontsize=9,
                fontweight="bold")
        ax.hlines(goal, i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.3)
        ax.text(i + 0.45, goal, f"goal {op} {goal:g}", ha="right", va="bottom", fontsize=7)
    ticks = [f"{n}\n{'co/single' if n == 'cobatch_overhead' else 'sliced/co'}" for n in GOALS]
    ax.set_xticks(range(len(GOALS)), ticks, fontsize=8)
    ax.set_ylabel("ratio of median forward_backward cycle times\n(error bars: min-max of per-rep ratios)", fontsize=8)
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
        ax.set_xticks(range(len(names)), names, fontsize=8)
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
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler attribution")
    parser.add_argument("--default-allocator", action="store_true", help="time under glibc's default malloc settings")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    reexec_with_tuned_allocator(not args.default_allocator)  # the trainer process's allocator settings

    import torch
    from tqdm import tqdm

    reps = args.reps or (2 if args.quick else 15)
    profile_rounds = 1 if args.quick else 5
    started = time.perf_counter()
    steps = 1 + len(VARIANTS) * (1 + reps) + (0 if args.no_profile else 2 * profile_rounds)
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
        samples = {v: {"forward_backward": [], "optim_step": [], "cpu_cycle": [], "cpu_forward_backward": []}
                   for v in VARIANTS}

        def timed(variant: str, record: bool) -> None:
            wall = {"fb": 0.0, "optim": 0.0}
            cpu = {"fb": 0.0, "optim": 0.0}
            for kind, fn in plans[variant]:
                start, cpu_start = time.perf_counter(), time.process_time()
                fn()
                harness.sync(args.device)
                wall[kind] += time.perf_counter() - start
                cpu[kind] += time.process_time() - cpu_start
            if record:
                s = samples[variant]
                s["forward_backward"].append(wall["fb"])
                s["optim_step"].append(wall["optim"])
                s["cpu_forward_backward"].append(cpu["fb"])
                s["cpu_cycle"].append(cpu["fb"] + cpu["optim"])

        # Warm-up: one of each (one-off allocations, the adapters' .grad and Adam buffers).
        for variant in VARIANTS:
            progress.set_postfix_str(f"warm-up: {variant}")
            timed(variant, record=False)
            progress.update()
        for rep in range(reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]  # rotate: no fixed position
            for variant in order:
                progress.set_postfix_str(f"rep {rep + 1}/{reps}: {variant}")
                timed(variant, record=True)
                progress.update()
            tqdm.write(f"rep {rep + 1}: " + ", ".join(
                f"{v} {samples[v]['forward_backward'][-1] + samples[v]['optim_step'][-1]:.3f}s" for v in VARIANTS))

        profiled = None
        if not args.no_profile:
            progress.set_postfix_str("profile")
            profiled = moe_profile.profile({"cobatched": lambda: cycle(engine, cobatched_items),
                                            "single_adapter": lambda: cycle(engine, single_items)}, profile_rounds)
            progress.update(2 * profile_rounds)
        progress.close()

    med = {v: {"forward_backward": report.median(s["forward_backward"]), "optim_step": report.median(s["optim_step"]),
               "cycle": report.median([a + b for a, b in zip(s["forward_backward"], s["optim_step"])]),
               "cpu_forward_backward": report.median(s["cpu_forward_backward"]), "cpu_cycle": report.median(s["cpu_cycle"])}
           for v, s in samples.items()}
    ratios, per_rep = ratios_of(samples, "forward_backward")
    with_optim, with_optim_spread = ratios_of(samples, "cycle")
    cpu_ratios = ratios_of(samples, "cpu_forward_backward")[0]
    top_k = int(getattr(config, "num_experts_per_tok"))
    result = {
        "benchmark": "moe",
        "ratios": ratios, "goal_met": {n: verdict(n, v) for n, v in ratios.items()}, "spread": per_rep,
        "ratios_with_optim_step": with_optim, "goal_met_with_optim_step": {n: verdict(n, v) for n, v in with_optim.items()},
        "spread_with_optim_step": with_optim_spread,
        "ratios_cpu_time": cpu_ratios, "goal_met_cpu_time": {n: verdict(n, v) for n, v in cpu_ratios.items()},
        "ratios_with_optim_step_cpu_time": ratios_of(samples, "cpu_cycle")[0],
        "goals": {n: f"{op} {g}" for n, (op, g) in GOALS.items()},
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
                       "outside ops; profiler overhead inflates small-op code (benchmarks/moe_profile.py)",
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
    report.print_ratios(
        ratios, GOALS, width=17,
        met={n: {"wall": result["goal_met"][n], "CPU time": result["goal_met_cpu_time"][n],
                 "with optim steps": result["goal_met_with_optim_step"][n]} for n in ratios},
        details={n: f"per rep {per_rep[n]['min']:.3f}-{per_rep[n]['max']:.3f}; CPU time {cpu_ratios[n]:.3f}; "
                    f"with optim steps {with_optim[n]:.3f}" for n in ratios})
    for name, prof in (profiled or {}).items():
        print(f"profile {name}: {prof['total_ms']:.1f} ms/cycle, experts {prof['experts_fraction']:.0%}: " + "; ".join(
            f"{label} {p['total_ms']:.1f}" for label, p in prof["pieces"].items()), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
