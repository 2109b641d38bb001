"""Vision-language co-batching benchmark: 8 tenants' LoRA adapters on the tiny Qwen3-VL-MoE, each sending one
image plus 64 text tokens (CPU, one torch thread).

Model: services/models/tiny_vision.py's ``qwen3_vl_moe`` (text hidden --hidden 256, --layers 4, 8 routed experts
top-2; a two-block vision tower with one deepstack merger), with a --vocab of 1,024 and the special tokens
at its end (the image token ids read from its config): at Qwen3's 151,936 rows the head would be 95 % of
this 64-wide model's compute, where in a real Qwen3-VL it is about a tenth. Each
tenant's datum is 32 text tokens, one --image-size square PNG of its own colour (N image tokens, from the
model's image processor) and 32 more text tokens, cross-entropy on every position. Adapters: rank 8 on
attention + MLP (routed experts included) as the trainer resolves them; --train-vision adds the tower.

Every timing is the trainer's real cycle path in process, without gRPC: the items decoded as the trainer's
servicer does (``convert.cycle_from_pb`` with the model's processor), then ``TrainerEngine.run_cycle``:

  cobatched       one cycle of the 8 tenants' forward_backward items (one datum each)
  single_adapter  one cycle of one item holding the same 8 datums, all on tenant-0
  time_sliced     a cycle per tenant (8 cycles)

  cobatch_overhead = cobatched / single_adapter      goal <= 1.15
  cobatch_gain     = time_sliced / cobatched          goal >= 1.2

Memory: one co-batched forward_backward in a fresh child process (peak RSS growth after a warm-up, glibc
returning freed blocks: harness.py's method) against the trainer's estimate for the same planned pass
(``ActivationModel.pass_bytes`` with the pass's image tokens), the adapters at --memory-rank 64, the rank
the estimate counts (as benchmarks/memory_estimate.py measures every family):

  memory_ratio = measured / estimated               goal 0.75 - 1.25

    python benchmarks/vlm.py             # about a minute on 2 CPU cores
    python benchmarks/vlm.py --quick     # 2 repetitions

The last stdout line is the result JSON; also written to benchmarks/results/vlm.json, with benchmarks/results/vlm.png.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)
import report
from temper.common.host_allocator import TUNED_MALLOC_ENV, reexec_with_tuned_allocator

HERE = Path(__file__).resolve().parent
GOALS = {"cobatch_overhead": ("<=", 1.15), "cobatch_gain": (">=", 1.2)}
MEMORY_GOAL = (0.75, 1.25)
VARIANTS = ("cobatched", "single_adapter", "time_sliced")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "cyan", "magenta")


def build_engine(folder: Path, args, checkpoint_dir: Path, **settings_overrides):
    from temper.services.lora.model import AdapterSpec
    from temper.services.models.loading import load_model
    from temper.services.trainer.engine import TrainerEngine
    from temper.services.trainer.settings import TrainerSettings

    loaded = load_model(str(folder), args.device, args.dtype, args.threads)
    settings = TrainerSettings(base_model=str(folder), checkpoint_dir=checkpoint_dir, device=args.device, dtype=args.dtype,
                               num_threads=args.threads, **settings_overrides)
    engine = TrainerEngine(loaded, settings)
    spec = AdapterSpec(rank=args.rank, alpha=harness.ALPHA,
                       targets=engine.lora.group_targets(attn=True, mlp=True, vision=args.train_vision))
    for i in range(args.tenants):
        engine.create_adapter(f"tenant-{i}", spec, seed=i)
    return engine


def image_datum(engine, colour: str, text_tokens: int, image_size: int, seed: int, with_image: bool = True):
    """32 text tokens, one image, 32 text tokens (--text-tokens in all), cross-entropy on every position."""
    import numpy as np
    from PIL import Image

    from temper.common.codec import encode_array, encode_tokens
    from temper.v1 import types_pb2

    vision = engine.loaded.vision
    png = io.BytesIO()
    Image.new("RGB", (image_size, image_size), colour).save(png, "PNG")
    n = vision.count(image_size, image_size)
    rng = np.random.default_rng(seed)
    before, after = text_tokens // 2, text_tokens - text_tokens // 2
    text = rng.integers(0, 500, text_tokens + 1)  # the tiny tokenizer's trained ids (below every special id)
    chunks = [types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(
                  tokens=encode_tokens(np.concatenate([text[:before - 1], [vision.tokens.start]])))),
              types_pb2.ModelInputChunk(image=types_pb2.ImageChunk(data=png.getvalue(), format="png", expected_tokens=n)),
              types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(
                  tokens=encode_tokens(np.concatenate([[vision.tokens.end], text[before:before + after - 1]]))))]
    if not with_image:  # the control: the same number of tokens, all text
        chunks = [types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(
            tokens=encode_tokens(rng.integers(0, 500, text_tokens + n))))]
    length = text_tokens + n
    targets = rng.integers(0, 500, length)
    return types_pb2.Datum(model_input=types_pb2.ModelInput(chunks=chunks),
                           loss_fn_inputs={"target_tokens": encode_array(targets, "int64"),
                                           "weights": encode_array(np.ones(length, np.float32), "float32")}), length, n


def cycle(engine, items: list) -> list:
    """One trainer RunCycle in process, as the servicer runs it (decoded with the model's processor, then the engine)."""
    from temper.services.trainer import convert
    from temper.v1 import trainer_pb2

    loaded = engine.loaded
    fb, optim = convert.cycle_from_pb(trainer_pb2.CycleRequest(forward_backward=items), loaded.vocab_size,
                                      loaded.max_context_length, vision=loaded.vision, model=loaded.name)
    results = engine.run_cycle(fb, optim)[0]
    for result in results:
        if isinstance(result, Exception):  # a refused item: the benchmark's input is wrong
            raise result
    return results


def inputs(engine, args):
    data = [image_datum(engine, COLOURS[i % len(COLOURS)], args.text_tokens, args.image_size, seed=i,
                        with_image=not args.text_only) for i in range(args.tenants)]
    keys = [f"tenant-{i}" for i in range(args.tenants)]
    return keys, [d for d, _, _ in data], data[0][1], data[0][2]


# ---- memory: one co-batched pass in a fresh child ------------------------------------------------


def memory_child(args) -> None:
    import gc

    from temper.services.trainer.memory import ActivationModel

    with tempfile.TemporaryDirectory() as tmp:
        # a budget far above the pass: its activations stored, as the estimate's stored case
        engine = build_engine(Path(args.model), args, Path(tmp), activation_memory_mib=1 << 20)
        keys, protos, length, n = inputs(engine, args)
        items = [harness.fb_item(k, [d]) for k, d in zip(keys, protos)]
        cycle(engine, items)  # warm-up: one-off allocations (gradients of the adapters, tower pixels)
        for adapter in engine.lora.adapters.values():
            for p in adapter.params.values():
                p.grad = None
        gc.collect()
        reset = harness._reset_peak_rss()
        base_kb = harness.peak_rss_kb()
        cycle(engine, items)
        peak_kb = harness.peak_rss_kb()
        model = ActivationModel.from_config(engine.loaded.model.config, next(engine.loaded.model.parameters()).dtype,
                                            lora_rank=args.rank, device=engine.device)
        tokens = args.tenants * length
        images = 0 if args.text_only else args.tenants * n
        estimate = model.pass_bytes(tokens, length, False, engine.logprob_chunk_tokens, images,
                                    images if args.train_vision else 0)
        # the adapters' gradients (kept between the two cycles? no: cleared above) are part of what the pass allocates
        grads = sum(p.numel() * 4 for a in engine.lora.adapters.values() for p in a.params.values() if p.requires_grad)
        out = {"delta_rss_bytes": (peak_kb - base_kb) * 1024, "estimated_bytes": estimate, "adapter_grad_bytes": grads,
               "peak_reset": reset, "tokens": tokens, "image_tokens": images,
               "passes": harness.describe_plan(engine, [length] * args.tenants)}
    print(harness.MEM_PREFIX + json.dumps(out), flush=True)


def measure_memory(args, folder: Path) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", "--model", str(folder), "--threads",
           str(args.threads), "--tenants", str(args.tenants), "--text-tokens", str(args.text_tokens), "--image-size",
           str(args.image_size), "--rank", str(args.memory_rank), "--hidden", str(args.hidden)]
    for flag in ("train_vision", "text_only"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC_ENV and k != "TEMPER_HOST_ALLOCATOR_TUNED"}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed blocks go back: RSS shows live tensors
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(harness.MEM_PREFIX):
            out = json.loads(line[len(harness.MEM_PREFIX):])
            out["ratio"] = out["delta_rss_bytes"] / out["estimated_bytes"]
            return out
    raise RuntimeError(f"memory child failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


# ---- results ---------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), dpi=90)
    ax = axes[0]
    for i, name in enumerate(GOALS):
        value, per_rep, (op, goal) = result["ratios"][name], result["per_rep"][name], GOALS[name]
        ax.bar(i, value, 0.6, color="#2f6db5", yerr=[[value - min(per_rep)], [max(per_rep) - value]], capsize=3)
        ax.text(i, value / 2, f"{value:.2f}", ha="center", color="white", fontweight="bold")
        ax.hlines(goal, i - 0.45, i + 0.45, colors="black", linestyles="--")
        ax.text(i + 0.45, goal, f"goal {op} {goal:g}", ha="right", va="bottom", fontsize=7)
    ax.set_xticks(range(len(GOALS)), ["co-batched / one adapter", "time-sliced / co-batched"], fontsize=8)
    ax.set_ylabel("ratio of median forward_backward cycle times")
    c = result["config"]
    ax.set_title(f"{c['tenants']} tenants x (1 image = {c['image_tokens']} tok + {c['text_tokens']} text tok), "
                 f"tiny Qwen3-VL-MoE, {c['threads']} thread", fontsize=8)
    ax = axes[1]
    m = result["memory"]
    ax.bar([0, 1], [m["estimated_bytes"] / 2**20, m["delta_rss_bytes"] / 2**20], color=["#999999", "#2f6db5"])
    ax.set_xticks([0, 1], ["estimated", "measured (peak RSS growth)"])
    ax.set_ylabel("MiB, one co-batched forward_backward")
    ax.set_title(f"memory estimate: measured / estimated = {m['ratio']:.2f} (goal {MEMORY_GOAL[0]}-{MEMORY_GOAL[1]})",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="text hidden size of the tiny model")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny model")
    parser.add_argument("--vocab", type=int, default=1024,
                        help="vocabulary (the special tokens at its end; 151936: Qwen3's own, whose head then dwarfs the "
                             "64-wide model: a real Qwen3-VL's head is about a tenth of its per-token compute)")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--text-tokens", type=int, default=64, help="text tokens per datum (around the image)")
    parser.add_argument("--image-size", type=int, default=64, help="side of each tenant's square image, pixels")
    parser.add_argument("--rank", type=int, default=8, help="the tenants' adapter rank in the timed cycles")
    parser.add_argument("--memory-rank", type=int, default=64,
                        help="adapter rank in the memory measurement: the rank the trainer's estimate counts "
                             "(ActivationModel.lora_rank), as benchmarks/memory_estimate.py measures it")
    parser.add_argument("--train-vision", action="store_true", help="adapters on the vision tower too")
    parser.add_argument("--text-only", action="store_true",
                        help="the control: each datum the same number of tokens, all text (no image)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cuda on a GPU machine (benchmarks/gpu_vlm.sh)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 9, --quick 2)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args)
        return 0
    reexec_with_tuned_allocator(True)  # the trainer process's allocator settings

    import torch
    from tqdm import tqdm

    from temper.services.models.tiny_vision import build_tiny_vl_model

    reps = args.reps or (2 if args.quick else 9)
    started = time.perf_counter()
    progress = tqdm(total=2 + len(VARIANTS) * (1 + reps), desc="vlm", unit="step", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="temper-vlm-") as tmp:
        progress.set_postfix_str("building the model and engine")
        folder = build_tiny_vl_model(Path(tmp) / "model", "qwen3_vl_moe", hidden_size=args.hidden,
                                     layers=args.layers, vocab_size=args.vocab)
        engine = build_engine(folder, args, Path(tmp) / "ckpt")
        torch.set_num_threads(args.threads)
        keys, protos, length, n = inputs(engine, args)
        plans = {"cobatched": [[harness.fb_item(k, [d]) for k, d in zip(keys, protos)]],
                 "single_adapter": [[harness.fb_item(keys[0], protos)]],
                 "time_sliced": [[harness.fb_item(k, [d])] for k, d in zip(keys, protos)]}
        samples = {v: {"wall": [], "cpu": []} for v in VARIANTS}
        progress.update()

        def timed(variant: str, record: bool) -> None:
            start, cpu_start = time.perf_counter(), time.process_time()
            for items in plans[variant]:
                cycle(engine, items)
            harness.sync(args.device)
            if record:
                samples[variant]["wall"].append(time.perf_counter() - start)
                samples[variant]["cpu"].append(time.process_time() - cpu_start)

        for variant in VARIANTS:
            progress.set_postfix_str(f"warm-up: {variant}")
            timed(variant, record=False)
            progress.update()
        for rep in range(reps):
            for variant in VARIANTS[rep % 3:] + VARIANTS[: rep % 3]:  # rotated: no fixed position
                progress.set_postfix_str(f"rep {rep + 1}/{reps}: {variant}")
                timed(variant, record=True)
                progress.update()
        progress.set_postfix_str("memory (child process)")
        # peak RSS is host memory: the measurement is the CPU trainer's (on a GPU the estimate is checked elsewhere)
        memory = measure_memory(args, folder) if args.device == "cpu" else {"ratio": float("nan"), "skipped": args.device}
        progress.update()
        progress.close()
        passes = harness.describe_plan(engine, [length] * args.tenants)

    def series(variant, kind="wall"):
        return samples[variant][kind]

    ratios, per_rep = report.cobatch_ratios(*(series(v) for v in ("cobatched", "single_adapter", "time_sliced")))
    cpu_ratios = report.cobatch_ratios(*(series(v, "cpu") for v in ("cobatched", "single_adapter", "time_sliced")))[0]
    goal_met = {name: report.goal_met(GOALS[name], value) for name, value in ratios.items()}
    goal_met["memory_ratio"] = bool(MEMORY_GOAL[0] <= memory["ratio"] <= MEMORY_GOAL[1])
    result = {
        "benchmark": "vlm", "ratios": {**ratios, "memory_ratio": memory["ratio"]}, "goal_met": goal_met,
        "goals": {**{n: f"{op} {g}" for n, (op, g) in GOALS.items()}, "memory_ratio": f"{MEMORY_GOAL[0]}-{MEMORY_GOAL[1]}"},
        "per_rep": per_rep, "ratios_cpu_time": cpu_ratios, "samples_s": samples, "memory": memory,
        "measures": {
            "cobatch_overhead": "median(one forward_backward cycle of 8 tenants' items, one image datum each) / "
                                "median(one cycle of one item with the same 8 datums on tenant-0)",
            "cobatch_gain": "median(8 cycles, one tenant each) / median(the co-batched cycle)",
            "memory_ratio": "peak RSS growth of one co-batched forward_backward in a fresh child / "
                            "ActivationModel.pass_bytes of that pass (image tokens and tower counted)",
        },
        "config": {"model": "tiny qwen3_vl_moe (services/models/tiny_vision.py)", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                   "tenants": args.tenants, "text_tokens": args.text_tokens, "image_size": args.image_size,
                   "image_tokens": 0 if args.text_only else n, "tokens_per_row": length, "rank": args.rank,
                   "train_vision": args.train_vision, "text_only": args.text_only,
                   "threads": args.threads, "device": args.device, "dtype": args.dtype, "reps": reps, "passes": passes, "torch": torch.__version__,
                   "python": platform.python_version(), "cpu_count": os.cpu_count(),
                   "load_average_at_end": os.getloadavg()},
        "total_seconds": time.perf_counter() - started,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "vlm" + ("_text_only" if args.text_only else "") + ("" if args.device == "cpu" else f"_{args.device.split(':')[0]}")
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.device == "cpu" and not args.text_only:
        plot(result, args.out_dir / "vlm.png")
    report.print_ratios(result["ratios"], result["goals"], goal_met, width=17)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
