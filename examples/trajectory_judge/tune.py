"""In-process LoRA tuning of SmolLM2 on the trajectory-judge data (no server).

Used to verify learnability and pick the demo's hyperparameters. Semantics match
the Temper trainer service:
  * model input = tokens[:-1], targets = tokens[1:], weights shifted the same way;
  * loss = SUM over tokens and datums of -logprob(target) * weight
    (weights come from render.build_sft_example: 0 on the prompt, completion
    weights normalized to sum to 1 per datum, answer letter upweighted);
  * torch.optim.AdamW(lr, betas, eps=1e-8, weight_decay=0) over LoRA params.
Evaluation: greedy first generated token of the assistant reply, parsed with
render.parse_answer (equivalent to sampling with temperature 0, max_tokens=1).

Run from the repo root:
    python -m examples.trajectory_judge.tune --rank 16 --lr 1e-3 --batch 4 --steps 80 --letter-weight 50
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from examples.trajectory_judge import data, render
from recipes.common import end_token_id

MODEL_DIR = "/root/.cache/temper/models/smollm2-135m-instruct"
ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@torch.no_grad()
def evaluate(model, tok, examples, show: int = 0) -> dict:
    model.eval()
    a_id, b_id = tok.encode("A", add_special_tokens=False)[0], tok.encode("B", add_special_tokens=False)[0]
    correct = parsed = logit_correct = 0
    by_kind: dict[str, list[int]] = {}
    firsts: dict[str, int] = {}
    for i, ex in enumerate(examples):
        ids = render.build_prompt_tokens(tok, ex)
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        first = tok.decode([int(logits.argmax())])
        ans = render.parse_answer(first)
        ok = ans == ex["better"]
        correct += ok
        parsed += ans is not None
        logit_correct += ("A" if logits[a_id] > logits[b_id] else "B") == ex["better"]
        by_kind.setdefault(ex["kind"], [0, 0])
        by_kind[ex["kind"]][0] += ok
        by_kind[ex["kind"]][1] += 1
        firsts[first] = firsts.get(first, 0) + 1
        if i < show:
            print(f"  [{ex['id']}] gold={ex['better']} first={first!r} -> {ans}")
    n = len(examples)
    return {
        "acc": correct / n,
        "parsed": parsed / n,
        "logit_acc": logit_correct / n,
        "by_kind": {k: f"{c}/{t}" for k, (c, t) in by_kind.items()},
        "first_tokens": dict(sorted(firsts.items(), key=lambda kv: -kv[1])[:6]),
    }


def batch_loss(model, batch, pad_id: int) -> tuple[torch.Tensor, int]:
    """SUM over datums/tokens of -logprob(target)*weight; batch = list of (tokens, weights)."""
    L = max(len(t) for t, _ in batch) - 1
    inp = torch.full((len(batch), L), pad_id, dtype=torch.long)
    tgt = torch.zeros((len(batch), L), dtype=torch.long)
    wts = torch.zeros((len(batch), L))
    att = torch.zeros((len(batch), L), dtype=torch.long)
    ntok = 0
    for i, (t, w) in enumerate(batch):
        n = len(t) - 1
        inp[i, :n] = torch.tensor(t[:-1])
        tgt[i, :n] = torch.tensor(t[1:])
        wts[i, :n] = torch.tensor(w[1:])
        att[i, :n] = 1
        ntok += n
    logits = model(input_ids=inp, attention_mask=att).logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return -(logp * wts).sum(), ntok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--targets", default=ALL_TARGETS)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--letter-weight", type=float, default=render.DEFAULT_LETTER_WEIGHT)
    ap.add_argument("--no-normalize", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=0, help="use only the first N train examples")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--skip-pre-eval", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 on a loaded machine)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="base weights' dtype (LoRA stays float32)")
    args = ap.parse_args()
    print(vars(args))

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=getattr(torch, args.dtype))
    print(f"load: {time.time() - t0:.1f}s")

    train, heldout = data.load_train(), data.load_heldout()
    if args.n_train:
        train = train[: args.n_train]
    sft = [
        render.build_sft_example(tok, ex, letter_weight=args.letter_weight, normalize=not args.no_normalize)
        for ex in train
    ]
    print(f"train {len(sft)} examples, {sum(len(t) for t, _ in sft)} tokens; heldout {len(heldout)}")

    if not args.skip_pre_eval:
        t0 = time.time()
        pre = evaluate(model, tok, heldout, show=3)
        print(f"PRE  eval ({time.time() - t0:.1f}s): {pre}")

    cfg = LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
        target_modules=args.targets.split(","), task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"lora params: {sum(p.numel() for p in params)}")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, args.beta2), eps=1e-8, weight_decay=0.0)

    rng = random.Random(args.seed)
    order: list[int] = []
    pad_id = end_token_id(tok)
    t_train = 0.0
    tok_total = 0
    for step in range(1, args.steps + 1):
        if len(order) < args.batch:
            perm = list(range(len(sft)))
            rng.shuffle(perm)
            order += perm
        idx, order = order[: args.batch], order[args.batch :]
        model.train()
        t0 = time.time()
        loss, ntok = batch_loss(model, [sft[i] for i in idx], pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dt = time.time() - t0
        t_train += dt
        tok_total += ntok
        print(f"step {step:3d} loss/datum {loss.item() / len(idx):.4f} {dt:.1f}s ({ntok / dt:.0f} tok/s) total {t_train:.0f}s", flush=True)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            t0 = time.time()
            r = evaluate(model, tok, heldout)
            print(f"  eval@{step} ({time.time() - t0:.1f}s): acc {r['acc']:.3f} logit_acc {r['logit_acc']:.3f} {r['by_kind']} {r['first_tokens']}")

    print(f"TRAIN: {args.steps} steps, {tok_total} tokens, {t_train:.1f}s, {tok_total / t_train:.0f} tok/s")
    t0 = time.time()
    post = evaluate(model, tok, heldout, show=3)
    print(f"POST eval ({time.time() - t0:.1f}s): {post}")


if __name__ == "__main__":
    main()
