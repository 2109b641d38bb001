"""DPO of a trajectory judge on SmolLM2 through forward_backward_custom, via a local Temper stack.

Pairs come from examples/trajectory_judge (same prompts as the SFT demo, rendered by render.py):
chosen = ``"<better letter>. <reason>"`` + eos, rejected = ``"<other letter>. <reason with A and B
swapped>"`` + eos, i.e. a fluent, self-consistent answer that contradicts the receipts. Reference
logprobs come from ``compute_logprobs`` on a sampling client of the base model; the policy's come
from ``forward_backward_custom``, whose client-side torch loss is

    -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))      (mean over the pairs of a batch)

with sequence logprobs summed over completion tokens only, plus ``--sft-weight`` (default 1) times
the chosen completions' mean per-token NLL (DPO+NLL as in RPO / Llama 3). Pure DPO
(``--sft-weight 0``) lowered both completions' likelihoods until the greedy first token became
"The" (held-out 0.125 after 20 steps on SmolLM2); the NLL term keeps the answer letter likely. Held-out accuracy is the greedy
first-token answer, exactly as the SFT demo measures it, before and after training.

    python -m recipes.dpo                     # SmolLM2-135M-Instruct, defaults (≈10 min on 2 CPUs)
    python -m recipes.dpo --beta 0.2 --steps 60

Writes runs/dpo/{metrics.jsonl, dpo.png, heldout_predictions.jsonl, summary.json} and prints one
final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from examples.trajectory_judge import render
from examples.trajectory_judge.data import load_heldout, load_train
from recipes.common import MetricsLog, add_common_args, finish, local_client, mean, plot_panels, weighted_datum
from temper.client import AdamParams, ModelInput, SamplingParams

SFT_DEMO_ACCURACY = 0.92  # examples/trajectory_judge/demo.py at its defaults (96 steps), for comparison


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "dpo", steps=20, learning_rate=1e-3)
    p.add_argument("--batch-pairs", type=int, default=4, help="preference pairs per step")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sft-weight", type=float, default=1.0,
                   help="add this times the chosen completion's mean per-token NLL (DPO+NLL, as in RPO / Llama 3); "
                        "0 = pure DPO, which on 2 CPUs collapsed the first token to 'The' (held-out 0.125)")
    p.add_argument("--max-heldout", type=int, default=0, help="evaluate on the first N held-out cases (0: all)")
    p.add_argument("--max-train", type=int, default=0, help="use the first N training examples (0: all)")
    return p.parse_args(argv)


def swap_letters(text: str) -> str:
    return re.sub(r"\b([AB])\b", lambda m: "B" if m.group(1) == "A" else "A", text)


def build_pair(tokenizer, example: dict) -> dict:
    """Prompt tokens plus chosen / rejected completion tokens (each ending with eos)."""
    eos = render.eos_token_id(tokenizer)
    worse = "B" if example["better"] == "A" else "A"
    chosen = f"{example['better']}. {example['reason']}"
    rejected = f"{worse}. {swap_letters(example['reason'])}"
    return {
        "prompt": render.build_prompt_tokens(tokenizer, example),
        "chosen": list(tokenizer.encode(chosen, add_special_tokens=False)) + [eos],
        "rejected": list(tokenizer.encode(rejected, add_special_tokens=False)) + [eos],
    }


def evaluate(sampler, tokenizer, examples, desc: str) -> tuple[float, list[dict]]:
    """Greedy first-token answer, as the SFT demo measures held-out accuracy."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    futures = [sampler.sample(ModelInput.from_ints(render.build_prompt_tokens(tokenizer, ex)), 1, greedy) for ex in examples]
    correct, rows = 0, []
    for ex, fut in zip(examples, tqdm(futures, desc=desc, unit="case", leave=False)):
        text = tokenizer.decode(fut.result().sequences[0].tokens)
        answer = render.parse_answer(text)
        correct += answer == ex["better"]
        rows.append({"id": ex["id"], "kind": ex["kind"], "better": ex["better"], "answer": answer, "text": text})
    return correct / len(examples), rows


def make_dpo_loss(ref_futures, beta: float, sft_weight: float = 0.0):
    """The client-side loss for forward_backward_custom; data alternate chosen, rejected, chosen, ...

    ``ref_futures`` are compute_logprobs futures of the same sequences on the base model, resolved
    inside the loss (so the reference pass overlaps the policy's forward pass)."""

    def loss_fn(data, logprobs: list[torch.Tensor]):
        seq_lp, ref_lp, token_mean = [], [], []
        for datum, lp, fut in zip(data, logprobs, ref_futures):
            mask = torch.from_numpy(datum.loss_fn_inputs["weights"].to_numpy().astype(np.float32))
            seq_lp.append((lp * mask).sum())
            token_mean.append(seq_lp[-1] / mask.sum())
            ref = fut.result()  # log p(token_i | <i) of model_input + last target; first is None
            completion = int(mask.sum().item())
            ref_lp.append(float(sum(ref[-completion:])))
        pi = torch.stack(seq_lp)
        ref = torch.tensor(ref_lp)
        chosen_reward = beta * (pi[0::2] - ref[0::2])
        rejected_reward = beta * (pi[1::2] - ref[1::2])
        margin = chosen_reward - rejected_reward
        dpo = -F.logsigmoid(margin).mean()
        nll = -torch.stack(token_mean[0::2]).mean()  # chosen completions, mean per-token NLL
        loss = dpo + sft_weight * nll if sft_weight else dpo
        metrics = {
            "dpo_loss": float(dpo.detach()), "chosen_nll": float(nll.detach()), "reward_accuracy": float((margin > 0).float().mean()),
            "margin": float(margin.detach().mean()), "chosen_reward": float(chosen_reward.detach().mean()),
            "rejected_reward": float(rejected_reward.detach().mean()),
            "chosen_logprob": float(pi[0::2].detach().mean()), "rejected_logprob": float(pi[1::2].detach().mean()),
        }
        return loss, metrics

    return loss_fn


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    train, heldout = load_train(), load_heldout()
    if args.max_train:
        train = train[: args.max_train]
    if args.max_heldout:
        heldout = heldout[: args.max_heldout]
    rng = random.Random(args.seed)
    adam = AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)

    with local_client(args) as client, MetricsLog(args.out_dir / "metrics.jsonl", started) as log:
        training = client.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed)
        tokenizer = training.get_tokenizer()
        reference = client.create_sampling_client(base_model=args.base_model)
        accuracy_before, _ = evaluate(reference, tokenizer, heldout, "eval before")
        log.write(kind="eval", step=0, heldout_accuracy=accuracy_before)
        pairs = [build_pair(tokenizer, ex) for ex in train]

        order: list[int] = []
        with tqdm(total=args.steps, desc="dpo", unit="step") as bar:
            for step in range(args.steps):
                if len(order) < args.batch_pairs:
                    order += rng.sample(range(len(pairs)), len(pairs))  # reshuffle each epoch
                batch, order = order[: args.batch_pairs], order[args.batch_pairs :]
                data = []
                for i in batch:
                    pair = pairs[i]
                    data += [weighted_datum(pair["prompt"], pair["chosen"]), weighted_datum(pair["prompt"], pair["rejected"])]
                ref_futures = [reference.compute_logprobs(ModelInput.from_ints(d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].to_numpy()[-1])]))
                               for d in data]
                fb = training.forward_backward_custom(data, make_dpo_loss(ref_futures, args.beta, args.sft_weight))
                opt = training.optim_step(adam)
                metrics = fb.result().metrics
                opt.result()
                row = log.write(kind="train", step=step + 1, **{k: metrics[k] for k in (
                    "dpo_loss", "chosen_nll", "reward_accuracy", "margin", "chosen_reward", "rejected_reward", "chosen_logprob", "rejected_logprob")})
                bar.set_postfix(loss=f"{row['dpo_loss']:.3f}", margin=f"{row['margin']:.2f}")
                bar.update()

        trained = training.save_weights_and_get_sampling_client("dpo-final")
        accuracy_after, rows = evaluate(trained, tokenizer, heldout, "eval after")
        log.write(kind="eval", step=args.steps, heldout_accuracy=accuracy_after)

    with open(args.out_dir / "heldout_predictions.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    train_rows = [r for r in log.rows if r["kind"] == "train"]
    steps = [r["step"] for r in train_rows]
    plot_panels(args.out_dir / "dpo.png", f"DPO judge: held-out accuracy {accuracy_before:.2f} → {accuracy_after:.2f} "
                                          f"(SFT demo ≈ {SFT_DEMO_ACCURACY:.2f})", [
        {"ylabel": "DPO loss (mean over pairs)", "series": [("dpo loss", steps, [r["dpo_loss"] for r in train_rows])]},
        {"ylabel": "implicit reward  β·(π − ref)", "series": [
            ("chosen", steps, [r["chosen_reward"] for r in train_rows]),
            ("rejected", steps, [r["rejected_reward"] for r in train_rows]),
            ("margin", steps, [r["margin"] for r in train_rows]),
        ]},
        {"ylabel": "fraction", "series": [
            ("batch reward accuracy", steps, [r["reward_accuracy"] for r in train_rows]),
            ("held-out accuracy (greedy letter)", [0, args.steps], [accuracy_before, accuracy_after]),
        ]},
    ])
    last = train_rows[-10:]
    summary = {
        "recipe": "dpo", "accuracy_before": round(accuracy_before, 4), "accuracy_after": round(accuracy_after, 4),
        "sft_demo_accuracy": SFT_DEMO_ACCURACY, "steps": args.steps, "batch_pairs": args.batch_pairs, "beta": args.beta,
        "sft_weight": args.sft_weight,
        "learning_rate": args.learning_rate, "dpo_loss_first": round(train_rows[0]["dpo_loss"], 4),
        "dpo_loss_last10": round(mean(r["dpo_loss"] for r in last), 4),
        "reward_accuracy_last10": round(mean(r["reward_accuracy"] for r in last), 4),
        "heldout": len(heldout), "train_pairs": len(pairs), "seconds": round(time.monotonic() - started, 1),
        "plot": str(args.out_dir / "dpo.png"), "metrics": str(args.out_dir / "metrics.jsonl"),
    }
    return finish(summary, args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
