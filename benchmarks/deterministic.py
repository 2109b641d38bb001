"""What deterministic mode costs (docs/deterministic.md): deterministic / default, side by side in one run.

  training  one co-batched run_cycle of 4 tenants x 2 datums x 128 tokens on SmolLM2 (CPU): every run
            deterministic / every run default.                                       goal <= 1.3
  decode    greedy decode of 4 prompts x 32 new tokens with a KV cache: the batch-invariant primitives
            and DecodeCache / the sampler's usual transformers decode (TorchSamplerBackend).  goal <= 1.5

Repetitions interleaved, medians reported with the raw samples. Writes benchmarks/results/deterministic.json
and .png; the last stdout line is the JSON.

    python benchmarks/deterministic.py [--reps 3] [--threads 2]
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
import torch

from temper.services.lora import deterministic as det
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.models.prepare import SMOLLM2_NAME
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import ForwardBackwardItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings
from temper.common.validation import DecodedDatum

SPEC = AdapterSpec(rank=8, alpha=16.0, targets=lora_targets(attn=True, mlp=True, unembed=True))


def cycle_items(deterministic: bool, vocab: int) -> list[ForwardBackwardItem]:
    rng = np.random.default_rng(0)
    items = []
    for run in range(4):
        data = [DecodedDatum(tokens=rng.integers(0, vocab, 128).astype(np.int32),
                             inputs={"target_tokens": rng.integers(0, vocab, 128), "weights": np.ones(128, np.float32)})
                for _ in range(2)]
        items.append(ForwardBackwardItem(f"run{run}", data, deterministic=deterministic))
    return items


def det_decode(lora, prompts: list[np.ndarray], new_tokens: int) -> list[list[int]]:
    model, rows, width = lora.model, len(prompts), max(len(p) for p in prompts)
    cache = det.DecodeCache(rows, width + new_tokens)
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(rows, width, dtype=torch.long)
    for r, p in enumerate(prompts):  # right-padded: each row's keys at their positions
        ids[r, :len(p)] = torch.from_numpy(p.astype(np.int64))
    out = [[] for _ in prompts]
    with det.deterministic(model, cache), torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(width)[None].expand(rows, -1)).logits
        logits = logits[torch.arange(rows), lengths - 1].float()
        for step in range(new_tokens):
            chosen = logits.argmax(-1)
            det.target_logprobs(logits, chosen[:, None])
            for r in range(rows):
                out[r].append(int(chosen[r]))
            logits = model(input_ids=chosen[:, None], position_ids=(lengths + step)[:, None]).logits[:, -1].float()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="det-bench-"))
    engine = TrainerEngine(load_model(SMOLLM2_NAME), TrainerSettings(checkpoint_dir=work / "ckpt"))
    for run in range(4):
        engine.create_adapter(f"run{run}", SPEC, run)
    sampler = TorchSamplerBackend(load_model(SMOLLM2_NAME))
    vocab = engine.loaded.vocab_size
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, n) for n in (20, 33, 47, 64)]
    options = SamplingOptions(max_tokens=32, temperature=0.0, stop_disabled=True)
    samples = {"train_default": [], "train_deterministic": [], "decode_default": [], "decode_deterministic": []}

    def timed(name, fn):
        start = time.perf_counter()
        fn()
        samples[name].append(time.perf_counter() - start)

    for rep in range(args.reps + 1):  # the first round warms up
        order = [("train_default", lambda: engine.run_cycle(cycle_items(False, vocab), [])),
                 ("train_deterministic", lambda: engine.run_cycle(cycle_items(True, vocab), [])),
                 ("decode_default", lambda: sampler.sample_batch([SampleRequest(None, p, 1, options, False) for p in prompts])),
                 ("decode_deterministic", lambda: det_decode(sampler.lora, prompts, 32))]
        for name, fn in order[rep % 2:] + order[:rep % 2]:
            timed(name, fn)
    for name in samples:
        samples[name] = samples[name][1:]
    med = {name: statistics.median(v) for name, v in samples.items()}
    result = {"training_ratio": med["train_deterministic"] / med["train_default"], "training_goal": 1.3,
              "decode_ratio": med["decode_deterministic"] / med["decode_default"], "decode_goal": 1.5,
              "medians_s": med, "samples_s": samples, "threads": args.threads, "model": SMOLLM2_NAME}
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "deterministic.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(["training", "decode"], [result["training_ratio"], result["decode_ratio"]], color="tab:blue")
        ax.scatter(["training", "decode"], [1.3, 1.5], color="tab:red", marker="_", s=800, label="goal")
        ax.set_ylabel("deterministic / default")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "deterministic.png")
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
