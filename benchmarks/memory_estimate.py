"""Checks the trainer's activation memory estimate (services/trainer/memory.py) against measured peak memory.

Each case is one forward_backward of the engine (chunked logprob head, 8 tenants x 1 row x T tokens)
in a fresh memory child (harness.py: peak RSS growth during the pass after a warm-up, glibc
returning freed blocks), with the decoder's activations stored (a budget far above the pass) or
checkpointed (every layer recomputed); the estimate is ``ActivationModel.pass_bytes`` for the same
pass. ``ratio`` = measured / estimated: below 1 the estimate is conservative (the trainer then
splits or checkpoints a little early), above 1 it would let a pass overrun its budget.

    python benchmarks/memory_estimate.py                     # SmolLM2, T = 128, 256, 512 stored; 512 checkpointed: ~2 min
    python benchmarks/memory_estimate.py --tokens 128 --checkpointed-tokens 256

Writes results/memory_estimate.json; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 256, 512], help="tokens per row, stored")
    parser.add_argument("--checkpointed-tokens", type=int, nargs="*", default=[512], help="tokens per row, checkpointed")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    harness.resolve_model(args)
    args.no_activation_checkpointing = False

    import torch
    from transformers import AutoConfig

    from temper.services.models.loading import resolve_model_path
    from temper.services.trainer.memory import ActivationModel
    from temper.services.trainer.numerics import default_logprob_chunk_tokens

    config = AutoConfig.from_pretrained(resolve_model_path(args.model))
    model = ActivationModel.from_config(config, getattr(torch, args.dtype))
    chunk = default_logprob_chunk_tokens(torch.device(args.device), model.vocab)
    started = time.perf_counter()
    cases = []
    for checkpointed, sizes in ((False, args.tokens), (True, args.checkpointed_tokens)):
        for tokens in sizes:
            args.memory_tokens = tokens
            # stored: a budget far above the pass (one pass, nothing recomputed); checkpointed: the
            # token rule at 0 (one pass, every layer recomputed)
            args.checkpoint_min_tokens, args.activation_memory_mib = (0, 0) if checkpointed else (None, 1 << 20)
            child = harness.run_memory_child(args, "chunked")
            measured = child["delta_rss_kb"] / 1024
            estimate = model.pass_bytes(harness.ROWS * tokens, tokens, checkpointed, chunk) / 2**20
            cases.append({"rows": harness.ROWS, "tokens_per_row": tokens, "checkpointed": checkpointed,
                          "measured_mib": measured, "estimated_mib": estimate, "ratio": measured / estimate,
                          "plan": child.get("plan"), "seconds": child["seconds"]})
            print(f"{harness.ROWS} x {tokens:4d} tokens, {'checkpointed' if checkpointed else 'stored      '}: measured "
                  f"{measured:7.0f} MiB, estimated {estimate:7.0f} MiB (ratio {measured / estimate:.2f})", file=sys.stderr)
    result = {
        "benchmark": "memory_estimate",
        "cases": cases,
        "measures": "peak RSS growth of one engine forward_backward (memory child) / ActivationModel.pass_bytes",
        "model": {k: getattr(model, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                                                 "dtype_bytes", "lora_rank", "eager_attention", "overhead")},
        "config": {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": args.threads,
                   "logprob_chunk_tokens": chunk, "rank": harness.RANK,
                   "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "total_seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "memory_estimate.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
