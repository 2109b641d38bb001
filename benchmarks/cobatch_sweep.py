"""Where co-batching pays on this machine: the co-batching gain of multitenant.py's (b) measured
for several tenant batch sizes, side by side in one run.

For each size T: 8 tenants x 1 datum x T tokens, time-sliced (8 run_cycle calls, one tenant per
pass) / co-batched (one run_cycle with the 8 items), repetitions interleaved in a rotating order,
medians. Under the trainer's allocator settings and defaults: the activation memory budget decides
whether a pass stores its activations, is split into micro-batches, or is checkpointed (each point
records the passes it ran). Where the deprecated token rule (checkpoint passes of >= 2048 padded
tokens, micro-batches of <= 4096) would run the co-batched pass differently, a third variant,
``cobatched_token_rule``, times that too on the same engine, so both policies read side by side.

    python benchmarks/cobatch_sweep.py                       # SmolLM2, T = 32..1024, ~12 min on 2 idle cores
    python benchmarks/cobatch_sweep.py --tokens 64 128 --reps 2

Writes results/cobatch_sweep.json and results/cobatch_sweep.png; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)
from temper.common.host_allocator import TUNED_MALLOC_ENV, reexec_with_tuned_allocator

HERE = Path(__file__).resolve().parent


TOKEN_RULE = (2048, 4096)  # the trainer's defaults before the memory budget: checkpoint >= 2048 padded tokens, micro-batches <= 4096


@contextlib.contextmanager
def token_rule(engine):
    """The engine under the deprecated token rule (settings are read at every call)."""
    s = engine.settings
    saved = (s.activation_checkpointing_min_tokens, s.max_tokens_per_microbatch)
    s.activation_checkpointing_min_tokens, s.max_tokens_per_microbatch = TOKEN_RULE
    try:
        yield
    finally:
        s.activation_checkpointing_min_tokens, s.max_tokens_per_microbatch = saved


def run_under_token_rule(engine, items):
    with token_rule(engine):
        return harness.run_cycle(engine, items)


def strip(plan: list[dict]) -> list[tuple]:
    return [(p["rows"], p["width"], p["checkpointed"]) for p in plan]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [p["tokens_per_tenant"] for p in result["points"]]
    gains = [p["cobatch_gain"] for p in result["points"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    ax.plot(sizes, gains, marker="o", color="#2f6db5", label="memory budget (default)")
    ax.plot(sizes, [p["cobatch_gain_token_rule"] for p in result["points"]], marker="x", color="#c8423a", linestyle=":",
            label="deprecated token rule (ckpt >= 2048 tokens)")
    for p in result["points"]:
        label = f"{p['cobatch_gain']:.2f}" + (" (ckpt)" if p["cobatched_checkpointed"] else "")
        ax.annotate(label, (p["tokens_per_tenant"], p["cobatch_gain"]), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.axhline(1.2, color="black", linestyle="--", linewidth=1, label="goal up to 256 tokens (1.2); 1.0 everywhere")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel(f"tokens per tenant ({harness.ROWS} tenants, 1 datum each)")
    ax.set_ylabel("time-sliced / co-batched" + (f" ({result['gain_measure']})" if result.get("gain_measure") else ""))
    c = result["config"]
    ax.set_title(f"Co-batching gain vs tenant batch size: {Path(c['model']).name}, {c['device']}, {c['threads']} threads",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024], help="tokens per tenant")
    parser.add_argument("--no-token-rule", action="store_true", help="skip the deprecated token rule's co-batched variant")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    reexec_with_tuned_allocator()  # the trainer process's allocator settings
    args.no_activation_checkpointing, args.checkpoint_min_tokens = False, None
    harness.resolve_model(args)
    started = time.perf_counter()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = harness.build_engine(args, Path(tmp), harness.ROWS)
        progress = tqdm(total=len(args.tokens) * (args.reps + 1) * 3, desc="cobatch sweep", unit="step", file=sys.stderr)
        for tokens in args.tokens:
            sequences = harness.random_sequences(harness.ROWS, tokens, engine.loaded.vocab_size, seed=tokens)
            items = [harness.fb_item(f"tenant-{i}", [harness.datum_proto(s)]) for i, s in enumerate(sequences)]
            variants = {"cobatched": lambda: harness.run_cycle(engine, items),
                        "time_sliced": lambda: [harness.run_cycle(engine, [item]) for item in items]}
            plans = {"cobatched": harness.describe_plan(engine, [tokens] * harness.ROWS),
                     "time_sliced": harness.describe_plan(engine, [tokens])}
            with token_rule(engine):
                plans["cobatched_token_rule"] = harness.describe_plan(engine, [tokens] * harness.ROWS)
            if not args.no_token_rule and strip(plans["cobatched_token_rule"]) != strip(plans["cobatched"]):
                variants["cobatched_token_rule"] = lambda: run_under_token_rule(engine, items)
            samples: dict[str, list[float]] = {name: [] for name in variants}
            cpu_samples: dict[str, list[float]] = {name: [] for name in variants}
            for rep in range(args.reps + 1):  # rep 0 warms this size up
                order = list(variants)[rep % len(variants):] + list(variants)[: rep % len(variants)]  # rotate
                for name in order:
                    progress.set_postfix_str(f"{tokens} tokens, rep {rep}: {name}")
                    start, cpu_start = time.perf_counter(), time.process_time()
                    variants[name]()
                    harness.sync(args.device)
                    if rep:
                        samples[name].append(time.perf_counter() - start)
                        cpu_samples[name].append(time.process_time() - cpu_start)
                    progress.update()
            med = {name: statistics.median(xs) for name, xs in samples.items()}
            cpu_med = {name: statistics.median(xs) for name, xs in cpu_samples.items()}
            token_rule_gain = med["time_sliced"] / med.get("cobatched_token_rule", med["cobatched"])
            points.append({
                "tokens_per_tenant": tokens, "cobatch_gain": med["time_sliced"] / med["cobatched"],
                # the deprecated token rule: its own timing where it plans differently, else the same passes
                "cobatch_gain_token_rule": token_rule_gain, "token_rule_timed": "cobatched_token_rule" in med,
                "medians_s": med, "samples_s": samples, "passes": plans,
                # the process's CPU seconds (user + system) per variant: on a shared machine with one
                # torch thread, the work each variant does, whatever share of the cores it was given
                "cobatch_gain_cpu_time": cpu_med["time_sliced"] / cpu_med["cobatched"],
                "cobatch_gain_token_rule_cpu_time": cpu_med["time_sliced"] / cpu_med.get("cobatched_token_rule", cpu_med["cobatched"]),
                "cpu_medians_s": cpu_med, "cpu_samples_s": cpu_samples,
                "cobatched_checkpointed": any(p["checkpointed"] for p in plans["cobatched"]),
                "tenant_pass_checkpointed": any(p["checkpointed"] for p in plans["time_sliced"]),
            })
            tqdm.write(f"{tokens:5d} tokens/tenant: gain {points[-1]['cobatch_gain']:.2f}, token rule {token_rule_gain:.2f}; "
                       f"CPU time: gain {points[-1]['cobatch_gain_cpu_time']:.2f}, token rule "
                       f"{points[-1]['cobatch_gain_token_rule_cpu_time']:.2f} "
                       f"({', '.join(f'{n} {m:.2f} s' for n, m in med.items())}; co-batched passes "
                       f"{[(p['rows'], p['checkpointed']) for p in plans['cobatched']]})")
        progress.close()
    result = {
        "benchmark": "cobatch_sweep",
        "points": points,
        "measures": "per size: median(8 run_cycle calls of 1 item each) / median(one run_cycle with the 8 items); "
                    "cobatch_gain_token_rule: the same with the co-batched cycle under the deprecated token rule",
        "config": {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": args.threads, "reps": args.reps,
                   "tenants": harness.ROWS, "rank": harness.RANK, "logprob_chunk_tokens": engine.logprob_chunk_tokens,
                   "activation_budget_mib": None if engine.activation_budget is None else engine.activation_budget / 2**20,
                   "activation_memory_fraction": engine.settings.activation_memory_fraction,
                   "max_tokens_per_microbatch": engine.settings.max_tokens_per_microbatch,
                   "token_rule": {"activation_checkpointing_min_tokens": TOKEN_RULE[0], "max_tokens_per_microbatch": TOKEN_RULE[1]},
                   "malloc_env": {k: os.environ.get(k) for k in TUNED_MALLOC_ENV},
                   "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "total_seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "cobatch_sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / "cobatch_sweep.png")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
