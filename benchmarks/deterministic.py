"""What deterministic mode costs (docs/deterministic.md): deterministic / default, side by side in one run.

  training  one co-batched trainer cycle (TrainerEngine.run_cycle: forward_backward + optim_step) of 4 runs
            x 2 datums of mixed lengths (24-128 tokens) on SmolLM2-135M: every run deterministic / every
            run default, same data, same adapters.                                               goal <= 1.3
  decode    one TorchSamplerBackend.sample_batch of 4 requests (one LoRA checkpoint each, prompts of
            20-100 tokens, 2 samples each, seeded temperature-1 draws, 32 new tokens, stop rules off, so
            both sides generate exactly 4 x 2 x 32 tokens: checked): SampleRequest.deterministic=True
            / False. The time includes the prompt prefill; tokens/s = generated tokens / that time.  goal <= 1.5

Deterministic passes run on one intra-op thread by design (services/lora/deterministic.py), the default
ones on --threads: on CPU the default sides are also timed on one thread (`*_default_1thread`, unless
--no-one-thread), which splits the ratio into the cost of the thread and the cost of the rest.

Repetitions interleaved in a rotating order after a warm-up round; medians are reported with the raw
samples, wall and process CPU seconds. The load average before and after is recorded (2-core machines
shared with other work swing). Then an equal-bits check (unless --no-bits-check), the contract itself
on this device and dtype: each run's logprobs and loss co-batched == that run alone (forward-only
deterministic cycles); each deterministic decode request batched == alone (tokens and logprobs); each
sampled token's logprob == the trainer's deterministic forward on the same tokens. The default path's
co-batched == alone is reported next to it as a control (it is not expected to hold).

    python benchmarks/deterministic.py [--reps 3] [--threads 2]
    python benchmarks/deterministic.py --device cuda --dtype bfloat16     # benchmarks/gpu_deterministic.sh

Writes <out-dir>/deterministic.json and .png (default benchmarks/results/); the last stdout line is the JSON.
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

import numpy as np
import torch
from tqdm import tqdm

import harness  # the benchmarks' shared helpers (this script's folder is first on sys.path)
from temper.common.host_allocator import TUNED_MALLOC_ENV, reexec_with_tuned_allocator

HERE = Path(__file__).resolve().parent
RUNS = 4
TRAIN_LENGTHS = (128, 40, 96, 72, 112, 24, 64, 128)   # run r trains datums of lengths [2r], [2r+1]
PROMPT_LENGTHS = (20, 45, 70, 100)                     # request r: checkpoint of run r
TRAINING_GOAL, DECODE_GOAL = 1.3, 1.5


def training_items(vocab: int, deterministic: bool, forward_only: bool = False):
    from temper.common.validation import DecodedDatum
    from temper.services.trainer.engine import ForwardBackwardItem

    rng = np.random.default_rng(0)
    items = []
    for run in range(RUNS):
        data = []
        for n in TRAIN_LENGTHS[2 * run:2 * run + 2]:
            tokens = rng.integers(0, vocab, n + 1)
            data.append(DecodedDatum(tokens=tokens[:-1].astype(np.int32),
                                     inputs={"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(n, np.float32)}))
        items.append(ForwardBackwardItem(f"run{run}", data, deterministic=deterministic, forward_only=forward_only))
    return items


def decode_requests(vocab: int, deterministic: bool, new_tokens: int, samples: int):
    from temper.services.sampler.backend import SampleRequest, SamplingOptions

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, n) for n in PROMPT_LENGTHS]
    return [SampleRequest(f"ckpt-run{r}", p, samples,
                          SamplingOptions(max_tokens=new_tokens, seed=100 + r, temperature=1.0, stop_disabled=True),
                          deterministic=deterministic)
            for r, p in enumerate(prompts)]


def cycle(engine, forward_backward: list, optim_step: list = ()) -> list:
    """engine.run_cycle on decoded items (as the trainer's servicer hands them over); raises a refusal."""
    results, steps = engine.run_cycle(forward_backward, list(optim_step))
    for outcome in (*results, *steps):
        if isinstance(outcome, Exception):  # the benchmark's input is wrong
            raise outcome
    return results


def generated(results) -> int:
    return sum(len(seq.tokens) for result in results for seq in result.sequences)


@contextlib.contextmanager
def threads(n: int | None):
    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def publish(engine, sampler) -> None:
    """Each run's current adapter saved by the trainer and loaded by the sampler as ckpt-run<r>."""
    for run in range(RUNS):
        key = f"bench/run{run}/ckpt-{time.monotonic_ns()}"
        engine.save(f"run{run}", key, include_optimizer=False)
        sampler.load_adapter(f"ckpt-run{run}", engine.store.existing(key))


def bits_check(engine, sampler, vocab: int, args) -> dict:
    """The contract on this device and dtype (module docstring); forward-only, nothing trained."""
    out = {}
    for deterministic in (True, False):
        together = cycle(engine, training_items(vocab, deterministic, forward_only=True))
        alone = [cycle(engine, [item])[0] for item in training_items(vocab, deterministic, forward_only=True)]
        equal = all(a.metrics["loss:sum"] == b.metrics["loss:sum"] and all(same_bits(x, y) for x, y in zip(a.logprobs, b.logprobs))
                    for a, b in zip(together, alone))
        out["training_cobatched_equals_alone" if deterministic else "control_default_training_cobatched_equals_alone"] = equal
    publish(engine, sampler)
    batched = sampler.sample_batch(decode_requests(vocab, True, args.new_tokens, args.samples))
    alone = [sampler.sample_batch([r])[0] for r in decode_requests(vocab, True, args.new_tokens, args.samples)]
    out["decode_batched_equals_alone"] = all(
        s.tokens == t.tokens and same_bits(s.logprobs, t.logprobs)
        for a, b in zip(batched, alone) for s, t in zip(a.sequences, b.sequences))
    from temper.common.validation import DecodedDatum
    from temper.services.trainer.engine import ForwardBackwardItem

    matches, total, worst = 0, 0, 0.0
    for r, (request, result) in enumerate(zip(decode_requests(vocab, True, args.new_tokens, args.samples), batched)):
        n = len(request.prompt)
        data = []
        for seq in result.sequences:
            tokens = np.asarray(request.prompt.tolist() + seq.tokens, np.int64)
            data.append(DecodedDatum(tokens=tokens[:-1].astype(np.int32),
                                     inputs={"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)}))
        trained = cycle(engine, [ForwardBackwardItem(f"run{r}", data, forward_only=True, deterministic=True)])[0]
        for seq, lp in zip(result.sequences, trained.logprobs):
            total += 1
            mine = np.asarray(seq.logprobs, np.float32)
            theirs = np.asarray(lp[n - 1:], np.float32)
            matches += same_bits(mine, theirs)
            worst = max(worst, float(np.abs(mine - theirs).max()))
    out["decode_logprobs_equal_trainer_forward"] = matches == total
    out["decode_sequences_equal_trainer_forward"] = f"{matches}/{total}"
    out["decode_max_abs_diff_to_trainer"] = worst
    out["all_equal"] = all(v for k, v in out.items() if k in ("training_cobatched_equals_alone", "decode_batched_equals_alone",
                                                                "decode_logprobs_equal_trainer_forward"))
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names, values, colors = [], [], []
    for side in ("training", "decode"):
        names.append(f"{side}\n/ default")
        values.append(result[side]["ratio"])
        colors.append("tab:blue")
        if result[side].get("ratio_vs_1thread_default") is not None:
            names.append(f"{side}\n/ 1-thread default")
            values.append(result[side]["ratio_vs_1thread_default"])
            colors.append("tab:gray")
    for k, name in enumerate(names):
        goal = TRAINING_GOAL if name.startswith("training") else DECODE_GOAL
        left.hlines(goal, k - 0.4, k + 0.4, colors="tab:red", linestyles="--", zorder=3, label="goal" if k == 0 else None)
    bars = left.bar(names, values, color=colors)
    left.bar_label(bars, fmt="%.2f", label_type="center", color="white")
    left.axhline(1.0, color="black", lw=0.5)
    left.set_ylabel("deterministic / default (median time)")
    left.legend(loc="lower right")
    left.tick_params(axis="x", labelsize=8)
    cfg = result["config"]
    left.set_title(f"{cfg['device']} {cfg['dtype']}, default on {cfg['threads']} threads, load average "
                   f"{cfg['loadavg_before'][0]:.1f} → {cfg['loadavg_after'][0]:.1f}", fontsize=9)
    tps = result["decode"]["tokens_per_s"]
    bars = right.bar(list(tps), list(tps.values()), color=["tab:blue" if "deterministic" in k else "tab:orange" for k in tps])
    right.bar_label(bars, fmt="%.0f")
    right.set_ylabel("decode tokens/s (prefill included)")
    right.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_model_arguments(parser, threads_help="torch threads of the default passes (deterministic ones use 1)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up round")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    parser.add_argument("--samples", type=int, default=2, help="samples per decode request")
    parser.add_argument("--no-one-thread", action="store_true", help="skip the 1-thread default variants (CPU)")
    parser.add_argument("--no-bits-check", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    reexec_with_tuned_allocator()  # the trainer process's allocator settings (both sides of every ratio share them)
    harness.resolve_model(args)
    torch.set_num_threads(args.threads)
    loadavg_before = os.getloadavg()
    started = time.perf_counter()

    from temper.services.lora.model import AdapterSpec
    from temper.services.models.loading import load_model
    from temper.services.sampler.torch_backend import TorchSamplerBackend
    from temper.services.trainer.adapters import lora_targets
    from temper.services.trainer.engine import AdamParams, OptimStepItem, TrainerEngine
    from temper.services.trainer.settings import TrainerSettings

    one_thread = args.device == "cpu" and args.threads > 1 and not args.no_one_thread
    variants = ["train_default", "train_deterministic", "decode_default", "decode_deterministic"]
    if one_thread:
        variants += ["train_default_1thread", "decode_default_1thread"]
    progress = tqdm(total=2 + len(variants) * (args.reps + 1) + (0 if args.no_bits_check else 1), desc="deterministic",
                    unit="step", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="det-bench-"))
    progress.set_postfix_str("loading trainer and sampler")
    settings = TrainerSettings(base_model=args.model, checkpoint_dir=work / "ckpt", device=args.device, dtype=args.dtype,
                               num_threads=args.threads)
    engine = TrainerEngine(load_model(args.model, args.device, args.dtype, args.threads), settings)
    spec = AdapterSpec(rank=8, alpha=16.0, targets=lora_targets(attn=True, mlp=True, unembed=True))
    for run in range(RUNS):
        engine.create_adapter(f"run{run}", spec, run)
    sampler = TorchSamplerBackend(load_model(args.model, args.device, args.dtype, args.threads), args.device)
    vocab = engine.loaded.vocab_size
    adam = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
    optim = [OptimStepItem(f"run{run}", adam) for run in range(RUNS)]
    progress.update()
    progress.set_postfix_str("first step, publishing checkpoints")  # adapters with B != 0 for the sampler
    cycle(engine, training_items(vocab, False), optim)
    publish(engine, sampler)
    progress.update()

    samples = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    tokens = {name: [] for name in variants if name.startswith("decode")}

    def train(deterministic: bool, n_threads: int | None = None):
        with threads(n_threads):
            cycle(engine, training_items(vocab, deterministic), optim)

    def decode(deterministic: bool, n_threads: int | None = None):
        with threads(n_threads):
            return sampler.sample_batch(decode_requests(vocab, deterministic, args.new_tokens, args.samples))

    calls = {"train_default": lambda: train(False), "train_deterministic": lambda: train(True),
             "decode_default": lambda: decode(False), "decode_deterministic": lambda: decode(True),
             "train_default_1thread": lambda: train(False, 1), "decode_default_1thread": lambda: decode(False, 1)}
    for rep in range(args.reps + 1):  # round 0 warms up
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for name in order:
            progress.set_postfix_str(f"rep {rep}/{args.reps}: {name}")
            wall, proc = time.perf_counter(), time.process_time()
            answer = calls[name]()
            harness.sync(args.device)
            wall, proc = time.perf_counter() - wall, time.process_time() - proc
            if name.startswith("decode"):
                made = generated(answer)
                expected = len(PROMPT_LENGTHS) * args.samples * args.new_tokens
                if made != expected:
                    raise SystemExit(f"{name} generated {made} tokens, expected {expected}: the sides did different work")
            if rep:
                samples[name].append(wall)
                cpu[name].append(proc)
                if name in tokens:
                    tokens[name].append(made)
            progress.update()

    bits = None
    if not args.no_bits_check:
        progress.set_postfix_str("equal-bits check")
        bits = bits_check(engine, sampler, vocab, args)
        progress.update()
    progress.close()
    loadavg_after = os.getloadavg()

    med = {name: statistics.median(xs) for name, xs in samples.items()}
    med_cpu = {name: statistics.median(xs) for name, xs in cpu.items()}
    made = len(PROMPT_LENGTHS) * args.samples * args.new_tokens

    def side(prefix: str, goal: float) -> dict:
        ratio = med[f"{prefix}_deterministic"] / med[f"{prefix}_default"]
        one = med.get(f"{prefix}_default_1thread")
        return {"ratio": ratio, "goal": goal, "met": ratio <= goal,
                "ratio_vs_1thread_default": med[f"{prefix}_deterministic"] / one if one else None,
                "cpu_ratio": med_cpu[f"{prefix}_deterministic"] / med_cpu[f"{prefix}_default"],
                "medians_s": {k: v for k, v in med.items() if k.startswith(prefix)},
                "cpu_medians_s": {k: v for k, v in med_cpu.items() if k.startswith(prefix)},
                "samples_s": {k: v for k, v in samples.items() if k.startswith(prefix)},
                "cpu_samples_s": {k: v for k, v in cpu.items() if k.startswith(prefix)}}

    training, decode_side = side("train", TRAINING_GOAL), side("decode", DECODE_GOAL)
    training["tokens"] = {"runs": RUNS, "datum_lengths": list(TRAIN_LENGTHS), "total": sum(TRAIN_LENGTHS)}
    decode_side["generated_tokens_per_call"] = made
    decode_side["generated_tokens_checked"] = tokens
    decode_side["tokens_per_s"] = {k.removeprefix("decode_"): made / v for k, v in med.items() if k.startswith("decode")}
    decode_side["requests"] = {"prompt_lengths": list(PROMPT_LENGTHS), "samples": args.samples, "new_tokens": args.new_tokens,
                               "temperature": 1.0, "seeded": True, "stop_disabled": True}
    result = {
        "benchmark": "deterministic",
        "training_ratio": training["ratio"], "training_goal": TRAINING_GOAL,
        "decode_ratio": decode_side["ratio"], "decode_goal": DECODE_GOAL,
        "training": training, "decode": decode_side, "equal_bits": bits,
        "config": {"model": args.model, "device": args.device, "dtype": args.dtype, "threads": args.threads,
                   "deterministic_threads": 1, "reps": args.reps, "adapter_rank": 8,
                   "malloc_env": {k: os.environ.get(k) for k in TUNED_MALLOC_ENV},
                   "loadavg_before": list(loadavg_before), "loadavg_after": list(loadavg_after), "cpus": os.cpu_count(),
                   "torch": torch.__version__, "wall_s": time.perf_counter() - started},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "deterministic.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / "deterministic.png")
    print(f"training deterministic/default {training['ratio']:.2f} (goal <= {TRAINING_GOAL}; "
          f"{med['train_deterministic']:.2f} s / {med['train_default']:.2f} s)", file=sys.stderr)
    print(f"decode   deterministic/default {decode_side['ratio']:.2f} (goal <= {DECODE_GOAL}; "
          f"{decode_side['tokens_per_s']['deterministic']:.0f} / {decode_side['tokens_per_s']['default']:.0f} tokens/s)",
          file=sys.stderr)
    if bits is not None:
        print(f"equal bits: {bits}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
