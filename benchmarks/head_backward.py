"""What recomputing the logprob head only where the gradient is not zero saves in a trainer step,
measured side by side in one run (``target_logprobs.head_target_logprobs`` against the previous
path: the whole chunk checkpointed, head recomputed and back-propagated on every position).

  sft_ratio   median engine.run_cycle time (one forward_backward) of the trajectory-judge
              demo's batches (4 SFT datums, weight 0 on the prompt: ~90% of positions), new / old.
  dense_ratio the same on 4 rows of random tokens weighted 1 everywhere (every row has a gradient:
              the new path's row selection is pure overhead there), new / old.

    python benchmarks/head_backward.py             # SmolLM2-135M, 2 threads, 5 reps: ~6 min on 2 cores
    python benchmarks/head_backward.py --reps 3

Repetitions interleave the variants (order alternating) after a warm-up; medians next to every sample.
Writes results/head_backward.json; the last stdout line is the same JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)
from temper.common.host_allocator import reexec_with_tuned_allocator
from temper.services.trainer import numerics
from temper.services.trainer.target_logprobs import target_logprobs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/ (run as a script from anywhere)
NEW = numerics.head_target_logprobs


def old_path(hidden, targets, logits_of):
    """The path before: the chunk's head and log-softmax checkpointed and recomputed on every row."""
    return checkpoint(lambda h, t: target_logprobs(logits_of(h), t), hidden, targets, use_reentrant=False)


def judge_batches(tokenizer, n: int, batch: int) -> list[list]:
    from examples.trajectory_judge import render
    from examples.trajectory_judge.data import load_train

    examples = [render.build_sft_example(tokenizer, ex) for ex in load_train()[: n * batch]]
    return [[weighted_proto(np.asarray(t), np.asarray(w, np.float32)) for t, w in examples[i:i + batch]]
            for i in range(0, n * batch, batch)]


def weighted_proto(tokens: np.ndarray, weights: np.ndarray):
    proto = harness.datum_proto(tokens)
    from temper.common.codec import encode_array

    proto.loss_fn_inputs["weights"].CopyFrom(encode_array(weights[1:], "float32"))
    return proto


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    reexec_with_tuned_allocator()
    harness.resolve_model(args)
    started = time.perf_counter()
    args.no_activation_checkpointing = False
    with tempfile.TemporaryDirectory() as tmp:
        engine = harness.build_engine(args, Path(tmp), 1)
        sft = judge_batches(engine.loaded.tokenizer, args.reps + 1, 4)
        dense = [[harness.datum_proto(s) for s in harness.random_sequences(4, 172, engine.loaded.vocab_size, seed=rep)]
                 for rep in range(args.reps + 1)]
        samples = {(kind, variant): [] for kind in ("sft", "dense") for variant in ("new", "old")}
        progress = tqdm(total=4 * (args.reps + 1), desc="head_backward", unit="cycle", file=sys.stderr)
        for rep in range(args.reps + 1):  # rep 0 warms up
            for kind, batches in (("sft", sft), ("dense", dense)):
                for variant in (("new", "old") if rep % 2 else ("old", "new")):
                    numerics.head_target_logprobs = NEW if variant == "new" else old_path
                    start = time.perf_counter()
                    harness.run_cycle(engine, [harness.fb_item("tenant-0", batches[rep])])
                    harness.sync(args.device)
                    if rep:
                        samples[(kind, variant)].append(time.perf_counter() - start)
                    progress.update()
        numerics.head_target_logprobs = NEW
        progress.close()
    med = {key: statistics.median(xs) for key, xs in samples.items()}
    result = {
        "benchmark": "head_backward",
        "sft_ratio": med[("sft", "new")] / med[("sft", "old")],
        "dense_ratio": med[("dense", "new")] / med[("dense", "old")],
        "medians_s": {f"{k}_{v}": m for (k, v), m in med.items()},
        "samples_s": {f"{k}_{v}": xs for (k, v), xs in samples.items()},
        "config": {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": args.threads,
                   "rows": 4, "reps": args.reps, "rank": harness.RANK},
        "total_seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "head_backward.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"head backward new/old: SFT batch {result['sft_ratio']:.2f}x, dense batch {result['dense_ratio']:.2f}x",
          file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
