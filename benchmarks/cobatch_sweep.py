"""Where co-batching pays on this machine: the co-batching gain of multitenant.py's (b) measured
for several tenant batch sizes, side by side in one run.

For each size T: 8 tenants x 1 datum x T tokens, time-sliced (8 run_cycle calls, one tenant per
pass) / co-batched (one run_cycle with the 8 items), repetitions interleaved in a rotating order,
medians. Under the trainer's allocator settings and defaults (so a co-batched pass of 2048 tokens or
more is activation-checkpointed while the tenants' own passes are not: the JSON says which).

    python benchmarks/cobatch_sweep.py                       # SmolLM2, T = 32..512, ~5 min on 2 cores
    python benchmarks/cobatch_sweep.py --tokens 64 128 --reps 2

Writes results/cobatch_sweep.json and results/cobatch_sweep.png; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
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


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [p["tokens_per_tenant"] for p in result["points"]]
    gains = [p["cobatch_gain"] for p in result["points"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    ax.plot(sizes, gains, marker="o", color="#2f6db5")
    for p in result["points"]:
        label = f"{p['cobatch_gain']:.2f}" + (" (ckpt)" if p["cobatched_checkpointed"] else "")
        ax.annotate(label, (p["tokens_per_tenant"], p["cobatch_gain"]), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.axhline(1.2, color="black", linestyle="--", linewidth=1, label="issue goal at 128 tokens (1.2)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel(f"tokens per tenant ({harness.ROWS} tenants, 1 datum each)")
    ax.set_ylabel("time-sliced / co-batched")
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
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128, 256, 512], help="tokens per tenant")
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
        progress = tqdm(total=len(args.tokens) * (args.reps + 1) * 2, desc="cobatch sweep", unit="step", file=sys.stderr)
        for tokens in args.tokens:
            sequences = harness.random_sequences(harness.ROWS, tokens, engine.loaded.vocab_size, seed=tokens)
            items = [harness.fb_item(f"tenant-{i}", [harness.datum_proto(s)]) for i, s in enumerate(sequences)]
            variants = {"cobatched": lambda: harness.run_cycle(engine, items),
                        "time_sliced": lambda: [harness.run_cycle(engine, [item]) for item in items]}
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for rep in range(args.reps + 1):  # rep 0 warms this size up
                order = list(variants) if rep % 2 == 0 else list(reversed(variants))
                for name in order:
                    progress.set_postfix_str(f"{tokens} tokens, rep {rep}: {name}")
                    start = time.perf_counter()
                    variants[name]()
                    harness.sync(args.device)
                    if rep:
                        samples[name].append(time.perf_counter() - start)
                    progress.update()
            med = {name: statistics.median(xs) for name, xs in samples.items()}
            points.append({
                "tokens_per_tenant": tokens, "cobatch_gain": med["time_sliced"] / med["cobatched"], "medians_s": med,
                "samples_s": samples,
                "cobatched_checkpointed": engine.settings.activation_checkpointing
                and harness.ROWS * tokens >= engine.settings.activation_checkpointing_min_tokens,
                "tenant_pass_checkpointed": engine.settings.activation_checkpointing
                and tokens >= engine.settings.activation_checkpointing_min_tokens,
            })
            tqdm.write(f"{tokens:5d} tokens/tenant: gain {points[-1]['cobatch_gain']:.2f} "
                       f"(time-sliced {med['time_sliced']:.2f} s, co-batched {med['cobatched']:.2f} s)")
        progress.close()
    result = {
        "benchmark": "cobatch_sweep",
        "points": points,
        "measures": "per size: median(8 run_cycle calls of 1 item each) / median(one run_cycle with the 8 items)",
        "config": {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": args.threads, "reps": args.reps,
                   "tenants": harness.ROWS, "rank": harness.RANK, "logprob_chunk_tokens": engine.logprob_chunk_tokens,
                   "activation_checkpointing_min_tokens": engine.settings.activation_checkpointing_min_tokens,
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
