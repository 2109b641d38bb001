"""On-policy distillation (per-token reverse KL) through a local Temper stack.

The student (a LoRA on the base model) samples completions of its own prompts; a teacher sampling
client scores the same completion tokens with ``compute_logprobs``; each completion token gets the
advantage ``teacher_logprob − student_logprob`` (minus the per-token reverse-KL estimate) and the
student trains on it with the ``importance_sampling`` loss (student logprobs = the sampler's).

Default teacher: the base model itself, *in a richer context* (context distillation): the teacher
sees a calculator system prompt and a few solved examples before the question, the student sees
only ``What is a + b?``. So the student learns to answer as the prompted teacher would (just the
number) without the prompt. With ``--teacher-path tinker://...`` the teacher is a saved checkpoint
(e.g. from recipes.rl_arithmetic) instead; add ``--teacher-context plain`` to give it the
student's own prompt.

Reported: mean per-token reverse KL  E_student[log p_student − log p_teacher]  on held-out prompts
before and after training (and per sequence), plus the student's exact-answer rate.

    python -m recipes.distill                                     # SmolLM2, base model as teacher
    python -m recipes.distill --teacher-path tinker://RUN/weights/NAME --teacher-context plain

Writes runs/distill/{metrics.jsonl, distill.png, heldout_samples.jsonl, summary.json} and prints
one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

from tqdm import tqdm

from recipes.common import MetricsLog, add_common_args, chat_prompt, completion_ratio_stats, finish, local_client, mean, plot_panels, rl_datum
from temper.client import AdamParams, ModelInput, SamplingParams

STUDENT_SYSTEM = "You are a helpful assistant."
TEACHER_SYSTEM = "You are a calculator. Reply with the number only, nothing else."
FEW_SHOT = [(12, 7), (23, 5), (8, 14)]
_INT = re.compile(r"-?\d+")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "distill", steps=12, learning_rate=2e-4)
    p.add_argument("--teacher-path", default=None, help="tinker://... checkpoint for the teacher (default: the base model)")
    p.add_argument("--teacher-context", choices=["fewshot", "plain"], default=None,
                   help="teacher prompt: fewshot (system prompt + solved examples; default for the base-model teacher) "
                        "or plain (the student's prompt; default with --teacher-path)")
    p.add_argument("--group-size", type=int, default=4, help="student samples per prompt")
    p.add_argument("--batch-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--kl-coef", type=float, default=1.0, help="advantage = kl_coef * (teacher lp − student lp)")
    p.add_argument("--heldout", type=int, default=32, help="held-out prompts for the KL measurement")
    p.add_argument("--eval-samples", type=int, default=2, help="student samples per held-out prompt")
    p.add_argument("--eval-every", type=int, default=4)
    return p.parse_args(argv)


def problems(seed: int, heldout: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(2, 41) for b in range(2, 41) if (a, b) not in FEW_SHOT]
    random.Random(seed + 99).shuffle(pairs)
    return pairs[heldout:], pairs[:heldout]


def student_prompt(tokenizer, a: int, b: int) -> list[int]:
    return chat_prompt(tokenizer, [{"role": "system", "content": STUDENT_SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}])


def teacher_prompt(tokenizer, a: int, b: int, context: str) -> list[int]:
    if context == "plain":
        return student_prompt(tokenizer, a, b)
    messages = [{"role": "system", "content": TEACHER_SYSTEM}]
    for x, y in FEW_SHOT:
        messages += [{"role": "user", "content": f"What is {x} + {y}?"}, {"role": "assistant", "content": str(x + y)}]
    messages.append({"role": "user", "content": f"What is {a} + {b}?"})
    return chat_prompt(tokenizer, messages)


def correct(text: str, a: int, b: int) -> float:
    m = _INT.search(text)
    return float(m is not None and int(m.group()) == a + b)


def rollouts(student, teacher, tokenizer, pairs, n: int, max_tokens: int, context: str, seed: int):
    """Sample n completions per prompt from the student, then score them with the teacher.

    Returns one dict per completion: prompt, tokens, student logprobs, teacher logprobs, text."""
    futures = [student.sample(ModelInput.from_ints(student_prompt(tokenizer, a, b)), n,
                              SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i)) for i, (a, b) in enumerate(pairs)]
    out = []
    for (a, b), fut in zip(pairs, futures):
        for seq in fut.result().sequences:
            if not seq.tokens:
                continue
            tprompt = teacher_prompt(tokenizer, a, b, context)
            out.append({"a": a, "b": b, "prompt": student_prompt(tokenizer, a, b), "tokens": seq.tokens, "student_lp": seq.logprobs,
                        "teacher": teacher.compute_logprobs(ModelInput.from_ints(tprompt + seq.tokens))})
    for r in out:  # all teacher requests are in flight before the first wait
        r["teacher_lp"] = r.pop("teacher").result()[-len(r["tokens"]):]
        r["text"] = tokenizer.decode(r["tokens"], skip_special_tokens=True)
        r["reverse_kl"] = [s - t for s, t in zip(r["student_lp"], r["teacher_lp"])]
    return out


def kl_stats(samples) -> dict[str, float]:
    return {
        "reverse_kl_per_token": mean(k for r in samples for k in r["reverse_kl"]),
        "reverse_kl_per_seq": mean(sum(r["reverse_kl"]) for r in samples),
        "completion_tokens": mean(len(r["tokens"]) for r in samples),
        "exact_answer": mean(correct(r["text"], r["a"], r["b"]) for r in samples),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    context = args.teacher_context or ("plain" if args.teacher_path else "fewshot")
    train_pairs, heldout_pairs = problems(args.seed, args.heldout)
    rng = random.Random(args.seed)
    adam = AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    evals: list[tuple[int, dict]] = []

    with local_client(args) as client, MetricsLog(args.out_dir / "metrics.jsonl", started) as log:
        training = client.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed)
        tokenizer = training.get_tokenizer()
        teacher = (client.create_sampling_client(model_path=args.teacher_path) if args.teacher_path
                   else client.create_sampling_client(base_model=args.base_model))
        bar = tqdm(total=args.steps, desc="distill", unit="step")
        for step in range(args.steps + 1):
            student = training.save_weights_and_get_sampling_client(f"distill-step-{step}")
            if step % args.eval_every == 0 or step == args.steps:
                held = rollouts(student, teacher, tokenizer, heldout_pairs, args.eval_samples, args.max_tokens, context, seed=10_000_000)
                stats = kl_stats(held)
                evals.append((step, stats))
                log.write(kind="eval", step=step, **stats)
                if step == args.steps:
                    break
            batch = rng.sample(train_pairs, args.batch_prompts)
            samples = rollouts(student, teacher, tokenizer, batch, args.group_size, args.max_tokens, context,
                               seed=args.seed * 1_000_003 + step * 1009)
            data = [rl_datum(r["prompt"], r["tokens"], r["student_lp"],
                             [args.kl_coef * (t - s) for s, t in zip(r["student_lp"], r["teacher_lp"])]) for r in samples]
            row = {"step": step + 1, **{f"train_{k}": v for k, v in kl_stats(samples).items()}}
            if data:
                fb = training.forward_backward(data, "importance_sampling")
                opt = training.optim_step(adam)
                output = fb.result()
                opt.result()
                row["loss"] = output.metrics.get("loss:sum")
                row.update(completion_ratio_stats(data, output, [len(r["prompt"]) for r in samples]))
            log.write(kind="train", **row)
            bar.set_postfix(kl=f"{row['train_reverse_kl_per_token']:.3f}", heldout_kl=f"{evals[-1][1]['reverse_kl_per_token']:.3f}")
            bar.update()
        bar.close()

    with open(args.out_dir / "heldout_samples.jsonl", "w") as f:
        f.writelines(json.dumps({k: r[k] for k in ("a", "b", "text", "student_lp", "teacher_lp")}) + "\n" for r in held)
    train_rows = [r for r in log.rows if r["kind"] == "train"]
    before, after = evals[0][1], evals[-1][1]
    plot_panels(args.out_dir / "distill.png",
                f"On-policy distillation: held-out reverse KL/token {before['reverse_kl_per_token']:.3f} → {after['reverse_kl_per_token']:.3f}", [
        {"ylabel": "reverse KL per token (nats)", "series": [
            ("train batch", [r["step"] for r in train_rows], [r["train_reverse_kl_per_token"] for r in train_rows]),
            ("held-out", [s for s, _ in evals], [e["reverse_kl_per_token"] for _, e in evals]),
        ]},
        {"ylabel": "student exact answer / tokens", "series": [
            ("held-out exact answer", [s for s, _ in evals], [e["exact_answer"] for _, e in evals]),
            ("held-out completion tokens / max", [s for s, _ in evals], [e["completion_tokens"] / args.max_tokens for _, e in evals]),
        ]},
    ])
    summary = {
        "recipe": "distill", "teacher": args.teacher_path or f"{args.base_model} (base)", "teacher_context": context,
        "reverse_kl_per_token_before": round(before["reverse_kl_per_token"], 4),
        "reverse_kl_per_token_after": round(after["reverse_kl_per_token"], 4),
        "reverse_kl_per_seq_before": round(before["reverse_kl_per_seq"], 4), "reverse_kl_per_seq_after": round(after["reverse_kl_per_seq"], 4),
        "exact_answer_before": round(before["exact_answer"], 4), "exact_answer_after": round(after["exact_answer"], 4),
        "completion_tokens_before": round(before["completion_tokens"], 2), "completion_tokens_after": round(after["completion_tokens"], 2),
        "steps": args.steps, "learning_rate": args.learning_rate, "heldout": len(heldout_pairs),
        "seconds": round(time.monotonic() - started, 1), "plot": str(args.out_dir / "distill.png"),
        "metrics": str(args.out_dir / "metrics.jsonl"),
    }
    return finish(summary, args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
