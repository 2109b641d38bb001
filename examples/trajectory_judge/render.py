"""Render judge examples into chat messages / token lists, and score replies (no torch import).

Prompt: ChatML via the tokenizer's chat template with a SHORT explicit system
message (SmolLM2's template otherwise inserts a long default system prompt).

Completion: ``"<letter>. <reason>"`` followed by the eos token ``<|im_end|>``.

Weights (what the demo sends to the trainer; loss = SUM over tokens and datums
of -logprob(target) * weight):
  * 0 on every prompt token;
  * on completion tokens, the answer-letter token gets ``letter_weight`` (default
    50) and each other completion token (reason + eos, ~15 tokens) gets 1; then the completion weights
    are normalized to sum to 1 per datum (as the Tinker cookbook does), so the
    summed loss over a batch is "number of datums x mean per-datum NLL" and the
    learning rate does not depend on reason length. With the default the letter
    carries ~75% of each datum's weight; with letter_weight 4 or 16 the model did
    not learn the letter within the CPU budget (it only learned the reason text).
Weights are returned aligned with ``tokens`` (weight i belongs to token i); the
trainer shifts tokens and weights the same way (input tokens[:-1], targets
tokens[1:], weights[1:]).
"""

from __future__ import annotations

import re

from recipes.common import chat_prompt, end_token_id

SYSTEM_PROMPT = "You judge agent attempts."
QUESTION = "Which is better, A or B? Give the letter, then one sentence why."
DEFAULT_LETTER_WEIGHT = 50.0


def _attempt_block(label: str, att: dict) -> str:
    return (
        f"[Attempt {label}]\n"
        f"trace: {att['trace']}\n"
        f"output: {att['output']}\n"
        f"receipts: {att['receipts']}"
    )


def build_messages(example: dict) -> list[dict]:
    user = (
        f"Task: {example['task']}\n"
        f"{_attempt_block('A', example['a'])}\n"
        f"{_attempt_block('B', example['b'])}\n"
        f"{QUESTION}"
    )
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


def completion_text(example: dict) -> str:
    return f"{example['better']}. {example['reason']}"


def build_prompt_tokens(tokenizer, example: dict) -> list[int]:
    return chat_prompt(tokenizer, build_messages(example))


def build_sft_example(
    tokenizer, example: dict, letter_weight: float = DEFAULT_LETTER_WEIGHT, normalize: bool = True
) -> tuple[list[int], list[float]]:
    prompt = build_prompt_tokens(tokenizer, example)
    completion = list(tokenizer.encode(completion_text(example), add_special_tokens=False))
    completion.append(end_token_id(tokenizer))
    cw = [1.0] * len(completion)
    cw[0] = float(letter_weight)  # first completion token is the answer letter ("A"/"B")
    if normalize:
        total = sum(cw)
        cw = [w / total for w in cw]
    return prompt + completion, [0.0] * len(prompt) + cw


_ANSWER_RE = re.compile(r"^[\W_]*(?:(?i:attempt)\s+|(?i:answer)\s*:?\s*)?([AB])\b")


def parse_answer(text: str) -> str | None:
    """Return "A"/"B" from the start of a reply like "A. reason" / "Attempt B ...", else None."""
    m = _ANSWER_RE.match(text or "")
    if m:
        return m.group(1).upper()
    return None


def score(examples: list[dict], replies: list[str]) -> tuple[float, list[dict]]:
    """Accuracy of the replies' answer letters against each example's better attempt, and one
    prediction row per example."""
    rows = []
    for ex, text in zip(examples, replies):
        rows.append({"id": ex["id"], "kind": ex["kind"], "better": ex["better"], "answer": parse_answer(text), "text": text})
    return sum(row["answer"] == row["better"] for row in rows) / len(examples), rows
