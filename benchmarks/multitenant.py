"""Multi-tenant training benchmark: what co-batching many LoRA adapters costs and gains.

Runs on SmolLM2-135M-Instruct on CPU by default and measures four ratios, each side by side in
the same run (repetitions interleaved in a rotating order, medians reported with the raw samples):

  (a) cobatch_overhead   one forward_backward pass over 8 adapters (8 rows x 128 tokens, one row per
                         adapter) / the same tokens in one pass on a single adapter.        goal <= 1.10
  (b) cobatch_gain       8 tenants x (1 datum x 128 tokens): 8 time-sliced run_cycle calls (one
                         tenant per pass) / one co-batched run_cycle with 8 items.           goal >= 1.2
  (c) scheduler_overhead forward_backward through client -> scheduler -> trainer (LocalStack) / the
                         same batch in-process on a TrainerEngine (engine.run_cycle).        goal <= 1.05
  (d) memory_ratio       activation memory (peak RSS - RSS before the pass) of a forward_backward of
                         8 x 512 tokens with the engine's chunked logprob path / full logits
                         (B x T x V materialized), each in a fresh subprocess after a short
                         warm-up pass, with the decoder checkpointed in both (one pass, every
                         layer recomputed: the token rule at 0; --no-activation-checkpointing
                         stores every activation). A further child runs the chunked pass under the
                         trainer's default memory budget (memory.default_plan).   goal <= 0.5

Every in-process timing is one trainer RunCycle without gRPC (``harness.run_cycle``: the items
decoded as the trainer's servicer does, then ``engine.run_cycle``) on a TrainerEngine with the
trainer's default settings; the stack's trainer runs with the same thread count, and it is idle (its CPU time is
recorded to show it) while the in-process variants run.

    python benchmarks/multitenant.py            # about 6-8 minutes on 2 CPU cores
    python benchmarks/multitenant.py --quick    # fewer repetitions, about 3 minutes

The last stdout line is the result JSON; it is also written to benchmarks/results/multitenant.json,
with a bar chart of the ratios against their goals in benchmarks/results/multitenant.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import report  # medians, goal verdicts, the ratio lines (this script's folder is first on sys.path)
from harness import (  # the benchmarks' shared helpers (this script's folder is first on sys.path)
    cpu_seconds,
    MEM_TOKENS,
    RANK,
    ROWS,
    add_model_arguments,
    build_engine,
    datum_proto,
    fb_item,
    fit_memory_tokens,
    memory_available_mib,
    random_sequences,
    resolve_model,
    run_cycle,
    run_memory_child,
    sync,
)

HERE = Path(__file__).resolve().parent
TOKENS = 128
GOALS = {  # name -> (comparison, goal)
    "cobatch_overhead": ("<=", 1.10),
    "cobatch_gain": (">=", 1.2),
    "scheduler_overhead": ("<=", 1.05),
    "memory_ratio": ("<=", 0.5),
}


# ---- stack bookkeeping ----------------------------------------------------------------------------


# ---- main -------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in GOALS if result["ratios"].get(n) is not None]
    values = [result["ratios"][n] for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=90)
    colors = ["#3a923a" if result["goal_met"][n] else "#c8423a" for n in names]
    bars = ax.bar(range(len(names)), values, color=colors, width=0.6)
    for i, n in enumerate(names):
        op, goal = GOALS[n]
        ax.hlines(goal, i - 0.38, i + 0.38, colors="black", linestyles="--", linewidth=1.4)
        ax.text(i, goal, f" goal {op} {goal:g}", ha="center", va="bottom", fontsize=7)
        ax.text(i, bars[i].get_height() / 2, f"{values[i]:.2f}", ha="center", va="center", color="white", fontsize=9,
                fontweight="bold")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("ratio")
    ax.set_ylim(0, max(values + [g for _, g in GOALS.values()]) * 1.2)
    c = result["config"]
    ax.set_title(f"Temper multi-tenant benchmark: {Path(c['model']).name} on {c['device']} ({c['threads']} threads, "
                 f"{c['reps']} reps)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "torch threads, in-process and in the stack's trainer")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about 3 minutes on 2 cores)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 7, --quick 2)")
    parser.add_argument("--no-stack", action="store_true", help="skip (c), which starts scheduler/trainer/sampler processes")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--memory-tokens", type=int, default=None,
                        help=f"tokens per row in (d) (default {MEM_TOKENS}, --quick {MEM_TOKENS // 2})")
    parser.add_argument("--no-memory-breakdown", action="store_true",
                        help="skip the decoder-only child that splits (d) into decoder and head memory (skipped by --quick)")
    parser.add_argument("--no-activation-checkpointing", action="store_true",
                        help="store decoder activations (trainer setting activation_checkpointing=False) in every variant")
    parser.add_argument("--checkpoint-min-tokens", type=int, default=None,
                        help="trainer setting activation_checkpointing_min_tokens (default: the trainer's)")
    parser.add_argument("--default-allocator", action="store_true",
                        help="time with glibc's default malloc settings, in-process and in the stack's trainer "
                             "(default: the trainer's tuned settings, temper.common.host_allocator)")
    args = parser.parse_args(argv)
    from temper.common.host_allocator import TUNED_MALLOC_ENV, reexec_with_tuned_allocator

    # The timed variants run under the allocator settings of the trainer process (the stack's
    # trainer applies them itself), so in-process and stack timings compare like with like.
    reexec_with_tuned_allocator(not args.default_allocator)
    resolve_model(args)
    if args.memory_tokens is None:
        args.memory_tokens = MEM_TOKENS // 2 if args.quick else MEM_TOKENS

    import torch
    from tqdm import tqdm

    reps = args.reps or (2 if args.quick else 6)
    memory_variants = ["chunked", "full"] + ([] if args.quick or args.no_memory_breakdown else ["decoder_only"])
    warm_all = not args.quick
    started = time.perf_counter()
    variants = ["cobatched", "single_adapter", "time_sliced"] + ([] if args.no_stack else ["stack"])
    progress = tqdm(total=len(memory_variants) + 1 + 1 + len(variants) * ((1 if warm_all else 0) + reps),
                    desc="multitenant", unit="step", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="temper-bench-"))

    # The stack starts (two model loads) while the memory children run: they measure memory, not time.
    stack, stack_thread, stack_box = None, None, {}
    if not args.no_stack:
        from temper.localstack import LocalStack

        extra = {"TEMPER_TRAINER_DEVICE": args.device, "TEMPER_TRAINER_DTYPE": args.dtype,
                 "TEMPER_TRAINER_TUNE_HOST_ALLOCATOR": str(not args.default_allocator).lower(),
                 "TEMPER_SAMPLER_DEVICE": args.device, "TEMPER_SAMPLER_DTYPE": args.dtype}
        stack = LocalStack(args.model, work / "stack", extra_env=extra, num_threads=args.threads)

        def start_stack():
            try:
                stack_box["address"] = stack.start()
            except BaseException as exc:  # noqa: BLE001 - reported below
                stack_box["error"] = exc

        stack_thread = threading.Thread(target=start_stack, daemon=True)
        stack_thread.start()

    client = None
    requested_memory_tokens = args.memory_tokens
    args.memory_tokens = fit_memory_tokens(args.memory_tokens, not args.no_activation_checkpointing)
    if args.memory_tokens != requested_memory_tokens:
        tqdm.write(f"memory: only {memory_available_mib():.0f} MiB available; (d) runs at {ROWS} x {args.memory_tokens} tokens "
                   f"instead of {ROWS} x {requested_memory_tokens}")
    try:
        memory = {}
        # (d) compares the logprob heads with the decoder checkpointed in both, as it always has: the
        # token rule at 0 tokens (one pass of all rows, every layer recomputed). The trainer's default
        # (the activation memory budget) would store this pass's activations where memory allows, and
        # then the decoder, not the head, would dominate both sides; the extra child below runs it.
        forced = argparse.Namespace(**vars(args))
        if args.checkpoint_min_tokens is None and not args.no_activation_checkpointing:
            forced.checkpoint_min_tokens = 0
        for variant in memory_variants:
            progress.set_postfix_str(f"memory: {variant}")
            memory[variant] = run_memory_child(forced, variant)
            progress.update()
            tqdm.write(f"memory {variant}: peak {memory[variant]['peak_rss_kb'] / 1024:.0f} MiB, "
                       f"delta {memory[variant]['delta_rss_kb'] / 1024:.0f} MiB ({memory[variant]['seconds']:.1f} s)")

        if args.checkpoint_min_tokens is None and not args.no_activation_checkpointing:
            progress.set_postfix_str("memory: the trainer's default plan")
            memory["default_plan"] = run_memory_child(args, "chunked")
            plan = memory["default_plan"]["plan"]
            tqdm.write(f"memory, default plan {[(p['rows'], p['checkpointed']) for p in plan]}: delta "
                       f"{memory['default_plan']['delta_rss_kb'] / 1024:.0f} MiB, estimated "
                       f"{max(p['estimate_mib'] or 0 for p in plan):.0f} MiB, budget "
                       f"{memory['default_plan']['activation_budget_mib'] or 0:.0f} MiB")

        progress.set_postfix_str("loading in-process engine")
        engine = build_engine(args, work / "ckpt", ROWS)
        vocab = engine.loaded.vocab_size
        sequences = random_sequences(ROWS, TOKENS, vocab, seed=0)
        protos = [datum_proto(s) for s in sequences]
        cobatched_items = [fb_item(f"tenant-{i}", [d]) for i, d in enumerate(protos)]
        single_items = [fb_item("tenant-0", protos)]

        stack_pids: list[int] = []
        if stack is not None:
            progress.set_postfix_str("waiting for the stack")
            stack_thread.join()
            if "error" in stack_box:
                raise stack_box["error"]
            from temper.client import Datum, ModelInput, ServiceClient

            client = ServiceClient(stack_box["address"], api_key=stack.api_key)
            tc = client.create_lora_training_client(args.model, rank=RANK, seed=0, train_mlp=True, train_attn=True,
                                                    train_unembed=False)
            client_data = [Datum(model_input=ModelInput.from_ints(s[:-1].tolist()),
                                 loss_fn_inputs={"target_tokens": s[1:], "weights": np.ones(TOKENS, np.float32)})
                           for s in sequences]
            stack_pids = [s.process.pid for s in stack.services]
        progress.update()

        def run_cobatched():
            run_cycle(engine, cobatched_items)

        def run_single():
            run_cycle(engine, single_items)

        def run_time_sliced():
            for item in cobatched_items:
                run_cycle(engine, [item])

        def run_stack():
            tc.forward_backward(client_data).result()

        fns = {"cobatched": run_cobatched, "single_adapter": run_single, "time_sliced": run_time_sliced, "stack": run_stack}
        samples: dict[str, list[float]] = {v: [] for v in variants}
        stack_busy = {"cpu_s": 0.0, "wall_s": 0.0}

        def timed(name: str) -> float:
            before = cpu_seconds(stack_pids) if name != "stack" else 0.0
            start = time.perf_counter()
            fns[name]()
            sync(args.device)
            seconds = time.perf_counter() - start
            if name != "stack" and stack_pids:
                stack_busy["cpu_s"] += cpu_seconds(stack_pids) - before
                stack_busy["wall_s"] += seconds
            return seconds

        # Warm-up: the first pass of a process pays one-off allocations. Quick mode warms only the
        # first pass of each process (in-process and the stack's trainer).
        progress.set_postfix_str("warm-up")
        timed("cobatched")
        if stack is not None:
            timed("stack")
        progress.update()
        if warm_all:
            for name in variants:
                timed(name)
                progress.update()

        for rep in range(reps):
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]  # rotate: no fixed position
            for name in order:
                progress.set_postfix_str(f"rep {rep + 1}/{reps}: {name}")
                samples[name].append(timed(name))
                progress.update()
            tqdm.write(f"rep {rep + 1}: " + ", ".join(f"{n} {samples[n][-1]:.2f}s" for n in variants))
        progress.close()
    finally:
        if client is not None:
            client.close()
        if stack is not None:
            if stack_thread is not None:
                stack_thread.join(timeout=600)
            stack.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {name: report.median(xs) for name, xs in samples.items()}
    ratios = {
        **report.cobatch_ratios(samples["cobatched"], samples["single_adapter"], samples["time_sliced"])[0],
        "scheduler_overhead": med["stack"] / med["single_adapter"] if "stack" in med else None,
        "memory_ratio": memory["chunked"]["delta_rss_kb"] / memory["full"]["delta_rss_kb"],
    }
    head_breakdown = {}
    if "decoder_only" in memory:  # the memory both paths share; what remains is the logprob head's
        decoder = memory["decoder_only"]["delta_rss_kb"]
        head_chunked, head_full = memory["chunked"]["delta_rss_kb"] - decoder, memory["full"]["delta_rss_kb"] - decoder
        head_breakdown = {"decoder_only_delta_mib": decoder / 1024, "head_chunked_delta_mib": head_chunked / 1024,
                          "head_full_delta_mib": head_full / 1024,
                          "head_only_ratio": head_chunked / head_full if head_full > 0 else None}
    result = {
        "benchmark": "multitenant",
        "ratios": ratios,
        "goals": {n: f"{op} {g}" for n, (op, g) in GOALS.items()},
        "goal_met": {n: report.goal_met(GOALS[n], v) for n, v in ratios.items()},
        "medians_s": med,
        "samples_s": samples,
        "measures": {
            "cobatch_overhead": "median(one run_cycle: 8 items, 8 adapters, 1 x 128 tokens each) / "
                                "median(one run_cycle: 1 item, 8 x 128 tokens, one adapter)",
            "cobatch_gain": "median(8 run_cycle calls of 1 item each) / median(one run_cycle with the 8 items)",
            "scheduler_overhead": "median(client forward_backward of 8 x 128 tokens through LocalStack, .result()) / "
                                  "median(in-process run_cycle of the same batch)",
            "memory_ratio": f"activation memory delta (peak RSS during the pass - RSS before it, peak mark reset after "
                            f"model load and a short warm-up pass, MALLOC_MMAP_THRESHOLD_=65536) of {ROWS} x "
                            f"{args.memory_tokens} tokens, whole forward_backward, decoder activation checkpointing "
                            f"{'off' if args.no_activation_checkpointing else 'on'} in both (one pass, token rule at "
                            f"{forced.checkpoint_min_tokens}): chunked logprob engine path / full B x T x V logits",
        },
        "memory": {
            "chunked": memory["chunked"], "full": memory["full"],
            "peak_ratio_raw": memory["chunked"]["peak_rss_kb"] / memory["full"]["peak_rss_kb"],
            "delta_ratio": ratios["memory_ratio"],
            "full_logits_tensor_mib": ROWS * args.memory_tokens * memory["full"]["vocab"] * 4 / 2**20,
            "head_saving_mib": (memory["full"]["delta_rss_kb"] - memory["chunked"]["delta_rss_kb"]) / 1024,
            **head_breakdown,
            # the same chunked pass under the trainer's default (the activation memory budget decides):
            # measured peak growth next to the estimate of its biggest pass and the budget
            "default_plan": memory.get("default_plan"),
        },
        "stack_idle_check": {"stack_cpu_s_during_inprocess": stack_busy["cpu_s"], "inprocess_wall_s": stack_busy["wall_s"]},
        "config": {
            "model": args.model, "device": args.device, "dtype": args.dtype, "threads": args.threads, "reps": reps,
            "quick": args.quick, "rows": ROWS, "tokens_per_row": TOKENS, "memory_tokens_per_row": args.memory_tokens, "memory_tokens_requested": requested_memory_tokens, "rank": RANK,
            "targets": "attn+mlp", "activation_checkpointing": engine.settings.activation_checkpointing,
            "activation_checkpointing_min_tokens": engine.settings.activation_checkpointing_min_tokens, "max_tokens_per_microbatch": engine.settings.max_tokens_per_microbatch,
            "logprob_chunk_tokens": engine.logprob_chunk_tokens, "torch": torch.__version__,
            "malloc_env": {k: os.environ.get(k) for k in TUNED_MALLOC_ENV},
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "total_seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "multitenant.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / "multitenant.png")
    report.print_ratios(ratios, GOALS, result["goal_met"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
