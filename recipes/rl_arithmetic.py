"""GRPO-style RL on exactly-scored addition ("What is 17 + 25?"), through a local Temper stack.

Task: ``What is a + b? Answer with the number only.`` for a, b in [2, 30], with the assistant turn
prefilled with ``"a + b ="`` so the completion is the answer; reward 1 if the first integer in the
completion equals a + b, else 0. A fixed set of (a, b) pairs is held out and never trained on.

Loop, one optimizer step per iteration: save_weights_and_get_sampling_client → sample G
completions per prompt (temperature 1) → reward each exactly → advantage = reward − group mean
(the same value on every completion token; groups with all-equal rewards are skipped) → datums
(model_input = prompt + completion[:-1], targets shifted, sampler logprobs and advantages on
completion positions, 0 on prompt positions) → forward_backward(importance_sampling | ppo) →
optim_step. Held-out accuracy (greedy, mean exact reward) is measured before training, every
``--eval-every`` steps, and at the end.

    python -m recipes.rl_arithmetic                       # SmolLM2-135M-Instruct, defaults
    python -m recipes.rl_arithmetic --loss ppo --steps 30

Writes runs/rl_arithmetic/{metrics.jsonl, rewards.png, heldout_predictions.jsonl (before and after),
summary.json}
and prints one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

from tqdm import tqdm

from recipes.common import (MetricsLog, add_common_args, chat_prompt, completion_ratio_stats, decode_replies, finish, greedy_futures,
                            local_client, mean, plot_panels, rl_datum)
from temper.client import AdamParams, ModelInput, SamplingParams

SYSTEM = "You are a helpful assistant."
_INT = re.compile(r"-?\d+")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "rl_arithmetic", steps=20, learning_rate=2e-4)
    p.add_argument("--loss", choices=["importance_sampling", "ppo"], default="importance_sampling")
    p.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt (G)")
    p.add_argument("--batch-prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--low", type=int, default=2, help="smallest operand")
    p.add_argument("--high", type=int, default=30, help="largest operand")
    p.add_argument("--heldout", type=int, default=64, help="held-out (a, b) pairs, never trained on")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--deterministic", action="store_true",
                   help="the run in deterministic mode (docs/deterministic.md): sampler and trainer logprobs are the same "
                        "bits, so on-policy steps report kl_sample_train 0 and importance ratios of exactly 1")
    return p.parse_args(argv)


def problems(low: int, high: int, heldout: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed + 1234).shuffle(pairs)
    heldout = min(heldout, len(pairs) // 2)
    return pairs[heldout:], pairs[:heldout]


def prompt_tokens(tokenizer, a: int, b: int) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
    return chat_prompt(tokenizer, messages, prefill=f"{a} + {b} =")


def reward(text: str, a: int, b: int) -> float:
    m = _INT.search(text)
    return float(m is not None and int(m.group()) == a + b)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    rng = random.Random(args.seed)
    train_pairs, heldout_pairs = problems(args.low, args.high, args.heldout, args.seed)
    loss_config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2} if args.loss == "ppo" else None
    adam = AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    evals: list[tuple[int, float]] = []
    predictions: list[dict] = []  # held-out answers before training and after the last step

    with local_client(args) as client, MetricsLog(args.out_dir / "metrics.jsonl", started) as log:
        training = client.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed,
                                                      deterministic=True if args.deterministic else None)
        tokenizer = training.get_tokenizer()
        bar = tqdm(total=args.steps, desc="rl", unit="step")
        for step in range(args.steps + 1):
            sampler = training.save_weights_and_get_sampling_client(f"rl-step-{step}")
            do_eval = step % args.eval_every == 0 or step == args.steps
            # Submit the held-out evaluation first so it shares the sampler's batches with the rollouts.
            eval_future = None
            if do_eval:
                eval_future = greedy_futures(sampler, [prompt_tokens(tokenizer, a, b) for a, b in heldout_pairs], args.max_tokens)
            if step == args.steps:  # the last iteration only evaluates the final weights
                acc, rows = evaluate_from(eval_future, tokenizer, heldout_pairs)
                evals.append((step, acc))
                predictions += [{"step": step, **r} for r in rows]
                log.write(kind="eval", step=step, heldout_reward=acc)
                break
            batch = rng.sample(train_pairs, args.batch_prompts)
            prompts = [prompt_tokens(tokenizer, a, b) for a, b in batch]
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                     seed=args.seed * 1_000_003 + step * 1009 + i) for i in range(len(batch))]
            rollouts = [sampler.sample(ModelInput.from_ints(p), args.group_size, sp) for p, sp in zip(prompts, params)]
            data, prompt_lengths, rewards, skipped = [], [], [], 0
            t_sample = time.monotonic()
            for (a, b), prompt, fut in zip(batch, prompts, rollouts):
                seqs = fut.result().sequences
                group = [reward(tokenizer.decode(s.tokens, skip_special_tokens=True), a, b) for s in seqs]
                rewards += group
                baseline = mean(group)
                if all(r == baseline for r in group):
                    skipped += 1  # no signal: every completion scored the same
                    continue
                for s, r in zip(seqs, group):
                    if s.tokens:
                        data.append(rl_datum(prompt, s.tokens, s.logprobs, r - baseline))
                        prompt_lengths.append(len(prompt))
            row = {"step": step + 1, "train_reward": mean(rewards), "groups_skipped": skipped, "datums": len(data),
                   "sample_s": round(time.monotonic() - t_sample, 1)}
            t_train = time.monotonic()
            if data:
                fb = training.forward_backward(data, args.loss, loss_config)
                opt = training.optim_step(adam)  # submitted before waiting: same scheduler cycle
                output = fb.result()
                opt.result()
                metrics = output.metrics
                row["loss"] = metrics.get("loss:sum")
                row.update(completion_ratio_stats(data, output, prompt_lengths))
                row["train_s"] = round(time.monotonic() - t_train, 1)
                if "clip_fraction:mean" in metrics:
                    row["clip_fraction"] = metrics["clip_fraction:mean"]
            if eval_future is not None:  # measured on the weights before this step's update
                acc, rows = evaluate_from(eval_future, tokenizer, heldout_pairs)
                evals.append((step, acc))
                if step == 0:
                    predictions += [{"step": step, **r} for r in rows]
                log.write(kind="eval", step=step, heldout_reward=acc)
            log.write(kind="train", **row)
            bar.set_postfix(reward=f"{row['train_reward']:.2f}", heldout=f"{evals[-1][1]:.2f}")
            bar.update()
        bar.close()

    with open(args.out_dir / "heldout_predictions.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in predictions)
    train_rows = [r for r in log.rows if r["kind"] == "train"]
    window = max(1, len(train_rows) // 10)
    smooth = [mean(r["train_reward"] for r in train_rows[max(0, i - window + 1): i + 1]) for i in range(len(train_rows))]
    plot_panels(args.out_dir / "rewards.png", f"RL arithmetic ({args.loss}): held-out reward {evals[0][1]:.2f} → {evals[-1][1]:.2f}", [
        {"ylabel": "mean exact reward", "series": [
            ("train (sampled, T=%.1f)" % args.temperature, [r["step"] for r in train_rows], [r["train_reward"] for r in train_rows]),
            (f"train, moving avg ({window})", [r["step"] for r in train_rows], smooth),
            ("held-out (greedy)", [s for s, _ in evals], [a for _, a in evals]),
        ]},
        {"ylabel": "datums trained / groups skipped", "series": [
            ("datums", [r["step"] for r in train_rows], [r["datums"] for r in train_rows]),
            ("groups skipped", [r["step"] for r in train_rows], [r["groups_skipped"] for r in train_rows]),
        ]},
    ])
    summary = {
        "recipe": "rl_arithmetic", "heldout_reward_before": round(evals[0][1], 4), "heldout_reward_after": round(evals[-1][1], 4),
        "heldout_reward_best": round(max(a for _, a in evals), 4), "evals": [[s, round(a, 4)] for s, a in evals],
        "train_reward_first": round(train_rows[0]["train_reward"], 4) if train_rows else None,
        "train_reward_last5": round(mean(r["train_reward"] for r in train_rows[-5:]), 4) if train_rows else None,
        "steps": args.steps, "loss": args.loss, "group_size": args.group_size, "batch_prompts": args.batch_prompts,
        "learning_rate": args.learning_rate, "heldout": len(heldout_pairs), "deterministic": args.deterministic,
        "kl_sample_train_max": max((abs(r["kl_sample_train"]) for r in train_rows if "kl_sample_train" in r), default=None), "seconds": round(time.monotonic() - started, 1),
        "plot": str(args.out_dir / "rewards.png"), "metrics": str(args.out_dir / "metrics.jsonl"),
    }
    return finish(summary, args.out_dir)


def evaluate_from(futures, tokenizer, pairs) -> tuple[float, list[dict]]:
    """Greedy held-out answers (futures submitted earlier) → mean exact reward and per-case rows."""
    texts = decode_replies(futures, tokenizer, skip_special_tokens=True)
    rows = [{"a": a, "b": b, "answer": a + b, "text": text, "reward": reward(text, a, b)} for (a, b), text in zip(pairs, texts)]
    return mean(r["reward"] for r in rows), rows


if __name__ == "__main__":
    sys.exit(main())
