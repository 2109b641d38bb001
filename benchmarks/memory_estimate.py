"""Checks the trainer's activation memory estimate (services/trainer/memory.py) against measured peak memory.

Each case is one forward_backward of the engine (chunked logprob head, 8 tenants x 1 row x T tokens)
in a fresh memory child (harness.py: peak RSS growth during the pass after a warm-up, glibc
returning freed blocks), with the decoder's activations stored (a budget far above the pass) or
checkpointed (every layer recomputed); the estimate is ``ActivationModel.pass_bytes`` for the same
pass. ``ratio`` = measured / estimated: below 1 the estimate is conservative (the trainer then
splits or checkpoints a little early), above 1 it would let a pass overrun its budget.

    python benchmarks/memory_estimate.py                     # SmolLM2, T = 128, 256, 512 stored; 512 checkpointed: ~2 min
    python benchmarks/memory_estimate.py --tokens 128 --checkpointed-tokens 256

``--families`` measures every model family Temper trains instead (services/models/families.py): a
tiny random model of each (services/models/tiny.py at a size where activations dominate: hidden 256,
4 layers, vocab 512; the MoE ones 8 routed experts, top-2), adapters as a run asks for attention and
MLP (``LoraModel.group_targets``: routed and shared experts, MLA's projections included) at rank 64,
the rank the estimate counts, 4 rows x 256 tokens (one CPU micro-batch) of 2 tenants, stored and
checkpointed. The estimate is the largest planned pass's, from ``ActivationModel.from_config`` of the
loaded model on this device. (The estimate does not count the adapters' weights stacked per pass
and their gradients, a constant per adapter: with one tenant per row they come to a third of a
checkpointed pass of this size.)

    python benchmarks/memory_estimate.py --families all      # 5 families x stored, checkpointed: ~2 min
    python benchmarks/memory_estimate.py --families qwen3_moe deepseek_v3 --family-tokens 128

Writes results/memory_estimate.json (the SmolLM2 ``cases``, the families' under ``families``; a run
keeps the other part); the last stdout line is the JSON.
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
    parser.add_argument("--families", nargs="*", default=None,
                        help="measure these families' tiny random models instead of --model ('all': every one)")
    parser.add_argument("--family-hidden", type=int, default=256)
    parser.add_argument("--family-layers", type=int, default=4)
    parser.add_argument("--family-vocab", type=int, default=512)
    parser.add_argument("--family-rows", type=int, default=4, help="rows per pass")
    parser.add_argument("--family-tenants", type=int, default=2, help="adapters the rows belong to (row i: tenant i mod n)")
    parser.add_argument("--family-tokens", type=int, default=256, help="tokens per row")
    parser.add_argument("--family-rank", type=int, default=64,
                        help="adapter rank (the estimate's: ActivationModel.lora_rank; routed experts get rank // top_k)")
    parser.add_argument("--models-dir", type=Path, default=None, help="where the tiny models are built (default: a temp folder)")
    parser.add_argument("--family-child", choices=("stored", "checkpointed"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.family_child:
        family_child(args)
        return 0
    if args.families is not None:
        return measure_families(args)
    harness.resolve_model(args)
    args.no_activation_checkpointing = False

    import torch
    from transformers import AutoConfig

    from temper.services.models.loading import resolve_model_path
    from temper.services.trainer.memory import ActivationModel
    from temper.services.trainer.numerics import default_logprob_chunk_tokens

    config = AutoConfig.from_pretrained(resolve_model_path(args.model))
    model = ActivationModel.from_config(config, getattr(torch, args.dtype), device=args.device)
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
    write_result(args.out_dir, result)
    print(json.dumps(result))
    return 0


def write_result(out_dir: Path, update: dict) -> None:
    """results/memory_estimate.json: the SmolLM2 run's keys, or the families' (``families``); what the
    file holds of the other part is kept."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "memory_estimate.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    if "families" in update:
        merged = {"benchmark": "memory_estimate", **old, **update}
    else:
        merged = {**update, **({"families": old["families"]} if "families" in old else {})}
    path.write_text(json.dumps(merged, indent=2) + "\n")


# ---- every family's tiny random model --------------------------------------------------------------


def family_child(args) -> None:
    """One forward_backward of ``--family-rows`` rows of ``--memory-tokens`` tokens, row i of tenant
    i mod ``--family-tenants`` (adapters on attention and MLP as a run asks for them), in this fresh
    process after a warm-up: peak RSS growth and the estimate of the planned passes. Prints a
    harness.MEM_PREFIX line."""
    import gc
    import tempfile

    import torch

    from temper.services.lora.model import AdapterSpec
    from temper.services.models.loading import load_model
    from temper.services.trainer.engine import TrainerEngine
    from temper.services.trainer.memory import ActivationModel
    from temper.services.trainer.settings import TrainerSettings

    checkpointed = args.family_child == "checkpointed"
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(args.model, args.device, args.dtype, args.threads)
        settings = TrainerSettings(base_model=args.model, checkpoint_dir=Path(tmp), device=args.device, dtype=args.dtype,
                                   num_threads=args.threads, activation_checkpointing=True)
        if checkpointed:  # the token rule at 0: every pass checkpointed
            settings.activation_checkpointing_min_tokens = 0
        else:             # a budget far above the pass: stored
            settings.activation_memory_mib = 1 << 20
        engine = TrainerEngine(loaded, settings)
        targets = engine.lora.group_targets(attn=True, mlp=True)
        spec = AdapterSpec(rank=args.family_rank, alpha=harness.ALPHA, targets=targets)
        tenants = max(1, min(args.family_tenants, args.family_rows))
        for i in range(tenants):
            engine.create_adapter(f"tenant-{i}", spec, seed=i)
        vocab = engine.loaded.vocab_size

        def run(sequences):  # one item per tenant: its rows, as a cycle brings them
            harness.run_cycle(engine, [harness.fb_item(f"tenant-{t}", [harness.datum_proto(s) for s in sequences[t::tenants]])
                                       for t in range(tenants)])

        run(harness.random_sequences(args.family_rows, 8, vocab, seed=2))  # one-off costs outside the measurement
        gc.collect()
        reset = harness._reset_peak_rss()
        baseline_kb = harness.peak_rss_kb()
        start = time.perf_counter()
        run(harness.random_sequences(args.family_rows, args.memory_tokens, vocab, seed=1))
        seconds = time.perf_counter() - start
        peak_kb = harness.peak_rss_kb()
        dtype = next(loaded.model.parameters()).dtype
        model = ActivationModel.from_config(loaded.model.config, dtype, device=engine.device)
        plan = harness.describe_plan(engine, [args.memory_tokens] * args.family_rows)
        estimates = [model.pass_bytes(p["rows"] * p["width"], p["width"], p["checkpointed"], engine.logprob_chunk_tokens)
                     for p in plan]
        out = {"delta_rss_kb": peak_kb - baseline_kb, "peak_reset": reset, "seconds": seconds, "plan": plan,
               "estimated_bytes": max(estimates), "targets": list(targets),
               "expert_rank": next(iter(engine.lora.adapters.values())).spec.expert_rank if engine.lora.adapters else 0,
               "attn_implementation": loaded.model.config._attn_implementation,
               "model": {k: v for k, v in vars(model).items()}}
    print(harness.MEM_PREFIX + json.dumps(out), flush=True)


def run_family_child(args, folder: Path, mode: str, tokens: int) -> dict:
    import subprocess

    from temper.common.host_allocator import TUNED_MALLOC_ENV

    cmd = [sys.executable, os.path.abspath(__file__), "--family-child", mode, "--model", str(folder), "--device", args.device,
           "--dtype", args.dtype, "--threads", str(args.threads), "--memory-tokens", str(tokens),
           "--family-rows", str(args.family_rows), "--family-tenants", str(args.family_tenants),
           "--family-rank", str(args.family_rank)]
    # as harness.run_memory_child: a fixed mmap threshold returns freed blocks, so RSS shows live tensors
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC_ENV and k != "TEMPER_HOST_ALLOCATOR_TUNED"}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(harness.MEM_PREFIX):
            return json.loads(line[len(harness.MEM_PREFIX):])
    raise RuntimeError(f"family child {mode} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


def measure_families(args) -> int:
    import tempfile

    from temper.services.models.tiny import TINY_FAMILIES, build_tiny_model

    names = list(TINY_FAMILIES) if not args.families or args.families == ["all"] else args.families
    unknown = sorted(set(names) - set(TINY_FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(TINY_FAMILIES)}")
    started = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = args.models_dir or Path(tmp)
        for family in names:
            folder = models_dir / f"{family}-h{args.family_hidden}-l{args.family_layers}-v{args.family_vocab}"
            build_tiny_model(folder, vocab_size=args.family_vocab, hidden_size=args.family_hidden,
                             layers=args.family_layers, family=family)
            for mode in ("stored", "checkpointed"):
                child = run_family_child(args, folder, mode, args.family_tokens)
                measured = child["delta_rss_kb"] / 1024
                estimate = child["estimated_bytes"] / 2**20
                cases.append({"family": family, "mode": mode, "rows": args.family_rows, "tokens_per_row": args.family_tokens,
                              "measured_mib": measured, "estimated_mib": estimate, "ratio": measured / estimate,
                              "seconds": child["seconds"], "plan": child["plan"], "targets": child["targets"],
                              "expert_rank": child["expert_rank"], "attn_implementation": child["attn_implementation"],
                              "model": child["model"]})
                print(f"{family:12s} {mode:12s}: measured {measured:7.1f} MiB, estimated {estimate:7.1f} MiB "
                      f"(ratio {measured / estimate:.2f})", file=sys.stderr)
    print(f"{'family':12s} {'stored':>7s} {'ckpt':>7s}   (measured / estimated)", file=sys.stderr)
    for family in names:
        ratio = {c["mode"]: c["ratio"] for c in cases if c["family"] == family}
        print(f"{family:12s} {ratio['stored']:7.2f} {ratio['checkpointed']:7.2f}", file=sys.stderr)
    families = {
        "cases": cases,
        "measures": "peak RSS growth of one engine forward_backward (fresh process) / the largest planned pass's "
                    "ActivationModel.pass_bytes",
        "config": {"hidden": args.family_hidden, "layers": args.family_layers, "vocab": args.family_vocab,
                   "rows": args.family_rows, "tenants": args.family_tenants, "tokens_per_row": args.family_tokens,
                   "rank": args.family_rank, "device": args.device, "dtype": args.dtype, "threads": args.threads,
                   "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "total_seconds": time.perf_counter() - started,
    }
    write_result(args.out_dir, {"families": families})
    print(json.dumps(families))
    return 0


if __name__ == "__main__":
    sys.exit(main())
