"""What decoder activation checkpointing costs in time and saves in memory (trainer setting
``TEMPER_TRAINER_ACTIVATION_CHECKPOINTING``), measured side by side in one run.

  time_ratio    median forward_backward time (engine.run_cycle, 8 adapters x 1 row), checkpointing
                on (for every pass: min_tokens 0) / off, two engines in this process, repetitions
                interleaved.
  memory_ratio  activation memory (peak RSS delta, fresh child per variant, as in multitenant.py's
                (d)), checkpointing on / off.

    python benchmarks/checkpointing.py                 # SmolLM2-135M, 8 x 256 tokens, ~4 min on 2 cores
    python benchmarks/checkpointing.py --tokens 128 --reps 3

Writes results/checkpointing.json; the last stdout line is the same JSON.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per row (8 rows, one per adapter)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    # timings under the trainer process's allocator settings (the memory children reset them)
    reexec_with_tuned_allocator()
    harness.resolve_model(args)
    started = time.perf_counter()
    progress = tqdm(total=2 + 2 + 2 * (args.reps + 1), desc="checkpointing", unit="step", file=sys.stderr)

    memory = {}
    for on in (True, False):
        child = argparse.Namespace(**{**vars(args), "memory_tokens": args.tokens, "no_activation_checkpointing": not on,
                                      "checkpoint_min_tokens": 0})
        progress.set_postfix_str(f"memory, checkpointing {'on' if on else 'off'}")
        memory[on] = harness.run_memory_child(child, "chunked")
        progress.update()

    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in (True, False):
            progress.set_postfix_str("loading engines")
            engines[on] = harness.build_engine(argparse.Namespace(**{**vars(args), "no_activation_checkpointing": not on,
                                                             "checkpoint_min_tokens": 0}),
                                          Path(tmp) / str(on), harness.ROWS)
            progress.update()
        sequences = harness.random_sequences(harness.ROWS, args.tokens, engines[True].loaded.vocab_size, seed=0)
        items = [harness.fb_item(f"tenant-{i}", [harness.datum_proto(s)]) for i, s in enumerate(sequences)]
        samples: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps + 1):  # rep 0 warms both up
            for on in ((True, False) if rep % 2 else (False, True)):
                progress.set_postfix_str(f"rep {rep}/{args.reps}: checkpointing {'on' if on else 'off'}")
                start = time.perf_counter()
                harness.run_cycle(engines[on], items)
                harness.sync(args.device)
                if rep:
                    samples[on].append(time.perf_counter() - start)
                progress.update()
    progress.close()

    med = {on: statistics.median(xs) for on, xs in samples.items()}
    result = {
        "benchmark": "checkpointing",
        "time_ratio": med[True] / med[False],
        "memory_ratio": memory[True]["delta_rss_kb"] / memory[False]["delta_rss_kb"],
        "medians_s": {"on": med[True], "off": med[False]},
        "samples_s": {"on": samples[True], "off": samples[False]},
        "memory_delta_mib": {"on": memory[True]["delta_rss_kb"] / 1024, "off": memory[False]["delta_rss_kb"] / 1024},
        "config": {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": args.threads,
                   "rows": harness.ROWS, "tokens_per_row": args.tokens, "reps": args.reps, "rank": harness.RANK,
                   "malloc_env": {k: os.environ.get(k) for k in TUNED_MALLOC_ENV}},
        "total_seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "checkpointing.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpointing on/off: time {result['time_ratio']:.2f}x, activation memory {result['memory_ratio']:.2f}x",
          file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
