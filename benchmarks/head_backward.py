"""What the head's sparse backward and a bfloat16 base save in a trainer step, measured side by
side in one run: ``target_logprobs.head_target_logprobs`` (the head recomputed and back-propagated only
on positions whose gradient is not zero) against the path before it (each logprob chunk checkpointed:
the head recomputed and back-propagated on every position), on a float32 and a bfloat16 base, with
a rank-16 adapter on every attention and MLP projection and on the head (the SDK's defaults).

  sft  the trajectory-judge demo's batches: 4 SFT datums, weight 0 on the prompt (~90% of positions)
  dense 4 rows of random tokens weighted 1 everywhere: every row is live, so the row selection is pure
       overhead there

Ratios (medians of engine.run_cycle, one forward_backward each; < 1 is faster):
  <dtype>_<kind>_sparse_over_checkpointed   the sparse backward's gain on that base
  demo_step_bf16_sparse_over_fp32_checkpointed   the demo's step now against before (issue 34)

    python benchmarks/head_backward.py             # SmolLM2-135M, 2 threads, 5 reps: ~5 min on 2 cores
    python benchmarks/head_backward.py --reps 3 --dtypes float32

Repetitions interleave the variants (order alternating) after a warm-up. Writes
results/head_backward.json; the last stdout line is the same JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)
import report
from temper.common.host_allocator import reexec_with_tuned_allocator
from temper.services.trainer import logprob_pass
from temper.services.trainer.target_logprobs import head_target_logprobs, target_logprobs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/ (run as a script from anywhere)


def checkpointed(hidden, targets, logits_of):
    """The path before: the chunk's head and log-softmax checkpointed and recomputed on every row."""
    return checkpoint(lambda h, t: target_logprobs(logits_of(h, None), t), hidden, targets, use_reentrant=False)


PATHS = {"sparse": head_target_logprobs, "checkpointed": checkpointed}


def judge_batches(tokenizer, n: int, batch: int) -> list[list]:
    from examples.trajectory_judge import render
    from examples.trajectory_judge.data import load_train
    from temper.common.codec import encode_array

    batches = []
    for i in range(n):
        protos = []
        for ex in load_train()[i * batch:(i + 1) * batch]:
            tokens, weights = render.build_sft_example(tokenizer, ex)
            proto = harness.datum_proto(np.asarray(tokens))
            proto.loss_fn_inputs["weights"].CopyFrom(encode_array(np.asarray(weights[1:], np.float32), "float32"))
            protos.append(proto)
        batches.append(protos)
    return batches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="base dtypes, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-unembed", action="store_true", help="no adapter on the head (the SDK trains one by default)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    reexec_with_tuned_allocator()
    harness.resolve_model(args)
    started = time.perf_counter()
    args.no_activation_checkpointing = False
    dtypes = args.dtypes.split(",")
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for dtype in dtypes:
            args.dtype = dtype
            engines[dtype] = harness.build_engine(args, Path(tmp) / dtype, 1, unembed=not args.no_unembed)
        tokenizer = next(iter(engines.values())).loaded.tokenizer
        data = {"sft": judge_batches(tokenizer, args.reps + 1, 4),
                "dense": [[harness.datum_proto(s) for s in harness.random_sequences(4, 172, tokenizer.vocab_size, rep)]
                          for rep in range(args.reps + 1)]}
        variants = [(d, k, p) for d in dtypes for k in data for p in PATHS]
        progress = tqdm(total=len(variants) * (args.reps + 1), desc="head_backward", unit="cycle", file=sys.stderr)
        for rep in range(args.reps + 1):  # rep 0 warms up
            for dtype, kind, path in (variants if rep % 2 else variants[::-1]):
                logprob_pass.head_target_logprobs = PATHS[path]
                start = time.perf_counter()
                harness.run_cycle(engines[dtype], [harness.fb_item("tenant-0", data[kind][rep])])
                harness.sync(args.device)
                if rep:
                    samples.setdefault(f"{dtype}_{kind}_{path}", []).append(time.perf_counter() - start)
                progress.update()
        logprob_pass.head_target_logprobs = head_target_logprobs
        progress.close()
    med = {key: report.median(xs) for key, xs in samples.items()}
    ratios = {f"{d}_{k}_sparse_over_checkpointed": med[f"{d}_{k}_sparse"] / med[f"{d}_{k}_checkpointed"]
              for d in dtypes for k in data}
    if {"float32", "bfloat16"} <= set(dtypes):
        ratios["demo_step_bf16_sparse_over_fp32_checkpointed"] = med["bfloat16_sft_sparse"] / med["float32_sft_checkpointed"]
    result = {"benchmark": "head_backward", "ratios": ratios, "medians_s": med, "samples_s": samples,
              "config": {"model": args.model, "device": args.device, "threads": args.threads, "dtypes": dtypes,
                         "rows": 4, "reps": args.reps, "rank": harness.RANK, "unembed": not args.no_unembed},
              "total_seconds": time.perf_counter() - started}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "head_backward.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
