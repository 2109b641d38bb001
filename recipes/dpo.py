"""DPO of a trajectory judge on SmolLM2 through forward_backward_custom, next to SFT on the same judgments.

Pairs come from examples/trajectory_judge (the SFT demo's prompts, rendered by render.py); the
judgment is the demo's completion, ``"<better letter>. <reason>"`` + eos. chosen = that judgment,
rejected = ``"<other letter>. <reason with A and B swapped>"`` + eos: a fluent, self-consistent
judgment that contradicts the receipts, so the two differ exactly where a letter names the better
attempt. Reference logprobs come from ``compute_logprobs`` on the base model, all asked for before
training (the reference never changes). The policy's come from ``forward_backward_custom``, whose
client-side torch loss is

    -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))      (mean over the pairs of a batch)

with sequence logprobs summed over completion tokens, plus ``--sft-weight`` times the SFT loss of
the chosen judgment (DPO+NLL as in RPO; 1 by default, 0 = pure DPO).

To compare objectives (the seed's step), a second LoRA run trains with the SFT demo's objective
(cross_entropy on the chosen judgment, answer letter weighted as in render.py) on the same
batches, learning rate and steps, in the same stack; each step the two runs' requests share
scheduler cycles. Held-out, for the base model, the DPO run and the SFT run:
  * accuracy: the greedy first token is the better letter (exactly as the SFT demo measures it);
  * preference accuracy: log p(better letter | prompt) > log p(other letter | prompt), from
    compute_logprobs, i.e. which verdict the model prefers even if neither is its top token.

    python -m recipes.dpo                      # SmolLM2-135M-Instruct, defaults
    python -m recipes.dpo --beta 0.2 --steps 60 --no-sft-baseline
    python -m recipes.dpo --verdict-only       # pairs of the letter alone (one (N, 2) datum per pair)

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
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from examples.trajectory_judge import render
from examples.trajectory_judge.data import load_heldout, load_train
from recipes.common import (MetricsLog, add_common_args, decode_replies, end_token_id, finish, greedy_futures, local_client, mean,
                            plot_panels, shifted_datum, weighted_datum)
from temper.client import AdamParams, Datum, ModelInput


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "dpo", steps=96, learning_rate=1e-3)
    p.add_argument("--batch-pairs", type=int, default=4, help="preference pairs per step")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sft-weight", type=float, default=1.0,
                   help="add this times the SFT loss of the chosen judgment (DPO+NLL, as in RPO); 0 = pure DPO, "
                        "which drove both likelihoods down on SmolLM2 (held-out greedy accuracy 0.0 after 64 steps)")
    p.add_argument("--verdict-only", action="store_true",
                   help="pairs of the answer letter alone instead of whole judgments (SFT baseline: the letter alone)")
    p.add_argument("--no-sft-baseline", action="store_true", help="skip the SFT run trained side by side")
    p.add_argument("--max-heldout", type=int, default=0, help="evaluate on the first N held-out cases (0: all)")
    p.add_argument("--max-train", type=int, default=0, help="use the first N training examples (0: all)")
    return p.parse_args(argv)


def swap_letters(text: str) -> str:
    return re.sub(r"\b([AB])\b", lambda m: "B" if m.group(1) == "A" else "A", text)


def letter_token(tokenizer, letter: str) -> int:
    ids = tokenizer.encode(letter, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the verdict {letter!r} is {len(ids)} tokens in this tokenizer; expected one")
    return int(ids[0])


def build_pair(tokenizer, example: dict, verdict_only: bool = False) -> dict:
    """Prompt tokens, chosen / rejected completion tokens and the SFT baseline's datum."""
    worse = "B" if example["better"] == "A" else "A"
    prompt = render.build_prompt_tokens(tokenizer, example)
    if verdict_only:
        chosen, rejected = [letter_token(tokenizer, example["better"])], [letter_token(tokenizer, worse)]
        weights = [0.0] * len(prompt) + [1.0]
        sft = shifted_datum(prompt + chosen, weights)
    else:
        eos = end_token_id(tokenizer)
        chosen = list(tokenizer.encode(render.completion_text(example), add_special_tokens=False)) + [eos]
        rejected = list(tokenizer.encode(f"{worse}. {swap_letters(example['reason'])}", add_special_tokens=False)) + [eos]
        sft = shifted_datum(*render.build_sft_example(tokenizer, example))  # the SFT demo's datum
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "sft": sft}


def pair_data(pair: dict) -> list[Datum]:
    """The policy's data for one pair: [chosen, rejected] datums (weight 1 on completion targets);
    for one-token completions a single datum whose (N, 2) targets end in [chosen, rejected], since
    the two share every earlier token (one forward pass gives both)."""
    if len(pair["chosen"]) > 1 or len(pair["rejected"]) > 1:
        return [weighted_datum(pair["prompt"], pair["chosen"]), weighted_datum(pair["prompt"], pair["rejected"])]
    prompt = pair["prompt"]
    shifted = np.asarray(prompt[1:] + pair["chosen"], np.int64)
    targets = np.stack([shifted, shifted], axis=1)
    targets[-1] = [pair["chosen"][0], pair["rejected"][0]]
    weights = np.zeros(targets.shape, np.float32)
    weights[-1] = 1.0
    return [Datum(model_input=ModelInput.from_ints(prompt), loss_fn_inputs={"target_tokens": targets, "weights": weights})]


def pair_logprobs(data, logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, 2) summed completion logprobs [chosen, rejected] and their token counts."""
    if logprobs[0].ndim == 2:  # one (N, 2) datum per pair
        pi = torch.stack([lp[-1] for lp in logprobs])
        return pi, torch.ones_like(pi)
    masks = [torch.from_numpy(d.loss_fn_inputs["weights"].to_numpy().astype(np.float32)) for d in data]
    sums = torch.stack([(lp * m).sum() for lp, m in zip(logprobs, masks)])
    return sums.view(-1, 2), torch.stack([m.sum() for m in masks]).view(-1, 2)


class ReferenceLogprobs:
    """Summed reference logprobs of each pair's chosen and rejected completion, from
    compute_logprobs on the base model; asked once per pair and kept (the reference never changes)."""

    def __init__(self, reference):
        self.reference = reference
        self.futures: dict[int, tuple] = {}
        self.lengths: dict[int, tuple[int, int]] = {}

    def request(self, index: int, pair: dict) -> None:
        if index not in self.futures:
            self.futures[index] = tuple(self.reference.compute_logprobs(ModelInput.from_ints(pair["prompt"] + pair[side]))
                                        for side in ("chosen", "rejected"))
            self.lengths[index] = (len(pair["chosen"]), len(pair["rejected"]))

    def get(self, index: int) -> tuple[float, float]:
        return tuple(float(sum(f.result()[-n:])) for f, n in zip(self.futures[index], self.lengths[index]))


def make_dpo_loss(references: Callable[[], list[tuple[float, float]]], beta: float, sft_weight: float = 0.0,
                  sft_data: list[Datum] | None = None):
    """The client-side loss for forward_backward_custom over ``pair_data`` of a batch of pairs.

    ``references()`` gives each pair's (ref_chosen, ref_rejected); it is called inside the loss, so
    the reference requests overlap the policy's forward pass. ``sft_data`` are the pairs' SFT
    datums (same tokens as the chosen completions): with ``sft_weight`` > 0 the loss adds that
    times the SFT objective of the chosen judgment (DPO+NLL)."""

    def loss_fn(data, logprobs: list[torch.Tensor]):
        pi, counts = pair_logprobs(data, logprobs)
        ref = torch.tensor(references(), dtype=pi.dtype)
        rewards = beta * (pi - ref)
        margin = rewards[:, 0] - rewards[:, 1]
        dpo = -F.logsigmoid(margin).mean()
        sft = sft_objective(data, logprobs, pi, sft_data)
        loss = dpo + sft_weight * sft if sft_weight else dpo
        metrics = {
            "dpo_loss": float(dpo.detach()), "policy_sft_loss": float(sft.detach()),
            "chosen_nll": float(-(pi[:, 0] / counts[:, 0]).detach().mean()),  # mean per-token NLL of chosen completions
            "reward_accuracy": float((margin > 0).float().mean()), "margin": float(margin.detach().mean()),
            "chosen_reward": float(rewards[:, 0].detach().mean()), "rejected_reward": float(rewards[:, 1].detach().mean()),
            "chosen_logprob": float(pi[:, 0].detach().mean()), "rejected_logprob": float(pi[:, 1].detach().mean()),
        }
        return loss, metrics

    return loss_fn


def sft_objective(data, logprobs: list[torch.Tensor], pi: torch.Tensor, sft_data: list[Datum] | None) -> torch.Tensor:
    """Mean over pairs of the SFT baseline's loss on the chosen completion: its weighted NLL (the
    demo's weights) for judgment pairs, the letter's NLL for verdict pairs."""
    if logprobs[0].ndim == 2 or sft_data is None:
        return -pi[:, 0].mean()
    losses = []
    for lp, datum in zip(logprobs[0::2], sft_data):
        weights = torch.from_numpy(datum.loss_fn_inputs["weights"].to_numpy().astype(np.float32))
        if weights.shape != lp.shape:
            raise ValueError("an SFT datum must hold the same tokens as its chosen completion")
        losses.append(-(lp * weights).sum())
    return torch.stack(losses).mean()


def evaluate(sampler, tokenizer, examples, desc: str) -> tuple[dict, list[dict]]:
    """Greedy first-token accuracy (as the SFT demo measures it) and preference accuracy
    (log p(better letter) > log p(other letter) after the prompt, from compute_logprobs)."""
    letters = {letter: letter_token(tokenizer, letter) for letter in "AB"}
    prompts = [render.build_prompt_tokens(tokenizer, ex) for ex in examples]
    samples = greedy_futures(sampler, prompts)
    letter_futures = [{k: sampler.compute_logprobs(ModelInput.from_ints(p + [t])) for k, t in letters.items()} for p in prompts]
    accuracy, rows = render.score(examples, decode_replies(samples, tokenizer, desc))
    preferred = 0
    for ex, row, futures in zip(examples, rows, letter_futures):
        letter_lp = {k: float(f.result()[-1]) for k, f in futures.items()}
        worse = "B" if ex["better"] == "A" else "A"
        preferred += letter_lp[ex["better"]] > letter_lp[worse]
        row.update(logprob_A=letter_lp["A"], logprob_B=letter_lp["B"])
    return {"accuracy": accuracy, "preference_accuracy": preferred / len(examples)}, rows


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
        policy = client.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed)
        sft = None if args.no_sft_baseline else client.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed)
        tokenizer = policy.get_tokenizer()
        base = client.create_sampling_client(base_model=args.base_model)
        references = ReferenceLogprobs(base)
        evals = {}
        evals["base"], _ = evaluate(base, tokenizer, heldout, "eval before")
        log.write(kind="eval", step=0, run="base", **evals["base"])
        pairs = [build_pair(tokenizer, ex, args.verdict_only) for ex in train]

        batches, order = [], []
        for _ in range(args.steps):
            if len(order) < args.batch_pairs:
                order += rng.sample(range(len(pairs)), len(pairs))  # reshuffle each epoch
            batches.append(order[: args.batch_pairs])
            order = order[args.batch_pairs :]
        # Reference logprobs of every pair first: the sampler then has the CPUs to itself, instead of
        # competing with the trainer for them during training.
        used = sorted({i for batch in batches for i in batch})
        for i in used:
            references.request(i, pairs[i])
        for i in tqdm(used, desc="reference logprobs", unit="pair", leave=False):
            references.get(i)

        with tqdm(total=args.steps, desc="dpo" + ("" if sft is None else " + sft"), unit="step") as bar:
            for step, batch in enumerate(batches):
                # Both runs' work is submitted before waiting, so the scheduler can co-batch it.
                sft_fb = sft.forward_backward([pairs[i]["sft"] for i in batch], "cross_entropy") if sft else None
                sft_opt = sft.optim_step(adam) if sft else None
                refs = lambda batch=batch: [references.get(i) for i in batch]  # noqa: E731
                fb = policy.forward_backward_custom([d for i in batch for d in pair_data(pairs[i])],
                                                    make_dpo_loss(refs, args.beta, args.sft_weight, [pairs[i]["sft"] for i in batch]))
                opt = policy.optim_step(adam)
                metrics = fb.result().metrics
                opt.result()
                extra = {}
                if sft is not None:
                    extra["sft_loss"] = sft_fb.result().metrics["loss:sum"] / len(batch)
                    sft_opt.result()
                row = log.write(kind="train", step=step + 1, **{k: metrics[k] for k in (
                    "dpo_loss", "policy_sft_loss", "chosen_nll", "reward_accuracy", "margin", "chosen_reward", "rejected_reward",
                    "chosen_logprob", "rejected_logprob")}, **extra)
                bar.set_postfix(loss=f"{row['dpo_loss']:.3f}", margin=f"{row['margin']:.2f}")
                bar.update()

        evals["dpo"], rows = evaluate(policy.save_weights_and_get_sampling_client("dpo-final"), tokenizer, heldout, "eval dpo")
        log.write(kind="eval", step=args.steps, run="dpo", **evals["dpo"])
        if sft is not None:
            evals["sft"], _ = evaluate(sft.save_weights_and_get_sampling_client("sft-final"), tokenizer, heldout, "eval sft")
            log.write(kind="eval", step=args.steps, run="sft", **evals["sft"])

    with open(args.out_dir / "heldout_predictions.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    train_rows = [r for r in log.rows if r["kind"] == "train"]
    steps = [r["step"] for r in train_rows]
    accuracy_series = []
    for run in ("dpo", "sft"):
        if run in evals:
            for metric, label in (("accuracy", "greedy letter"), ("preference_accuracy", "p(better) > p(other)")):
                accuracy_series.append((f"{run.upper()} held-out, {label}", [0, args.steps], [evals["base"][metric], evals[run][metric]]))
    title = f"DPO judge: held-out accuracy {evals['base']['accuracy']:.2f} → {evals['dpo']['accuracy']:.2f}" + (
        f" (SFT side by side: {evals['sft']['accuracy']:.2f})" if "sft" in evals else "")
    plot_panels(args.out_dir / "dpo.png", title, [
        {"ylabel": "DPO loss (mean over pairs)", "series": [("dpo loss", steps, [r["dpo_loss"] for r in train_rows])]},
        {"ylabel": "implicit reward  β·(π − ref)", "series": [
            ("chosen", steps, [r["chosen_reward"] for r in train_rows]),
            ("rejected", steps, [r["rejected_reward"] for r in train_rows]),
            ("margin", steps, [r["margin"] for r in train_rows]),
        ]},
        {"ylabel": "fraction", "series": [("batch reward accuracy", steps, [r["reward_accuracy"] for r in train_rows]),
                                          *accuracy_series]},
    ])
    last = train_rows[-10:]
    summary = {
        "recipe": "dpo", "pairs": "verdict" if args.verdict_only else "judgment",
        "accuracy_before": round(evals["base"]["accuracy"], 4), "accuracy_after": round(evals["dpo"]["accuracy"], 4),
        "sft_accuracy_after": round(evals["sft"]["accuracy"], 4) if "sft" in evals else None,
        "preference_accuracy": {run: round(e["preference_accuracy"], 4) for run, e in evals.items()},
        "steps": args.steps, "batch_pairs": args.batch_pairs, "beta": args.beta, "sft_weight": args.sft_weight,
        "learning_rate": args.learning_rate, "dpo_loss_first": round(train_rows[0]["dpo_loss"], 4),
        "dpo_loss_last10": round(mean(r["dpo_loss"] for r in last), 4),
        "reward_accuracy_last10": round(mean(r["reward_accuracy"] for r in last), 4),
        "heldout": len(heldout), "train_pairs": len(pairs), "seconds": round(time.monotonic() - started, 1),
        "plot": str(args.out_dir / "dpo.png"), "metrics": str(args.out_dir / "metrics.jsonl"),
    }
    return finish(summary, args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
