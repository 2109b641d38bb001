"""Sampler–trainer logprob parity, through the real stack.

For one trained adapter (and the base model): sample completions, then ask the trainer
(forward, no gradients) and the sampler (compute_logprobs) for the logprobs of the same tokens.
Prints the max absolute differences as a final JSON line. Goal: ≤ 1e-4 in fp32 on CPU.

    python benchmarks/parity.py                       # SmolLM2-135M-Instruct
    python benchmarks/parity.py --base-model <folder> --steps 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from temper.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from temper.localstack import LocalStack
from temper.services.models.prepare import SMOLLM2_NAME, prepare_smollm2

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about rivers.",
    "List three prime numbers.",
    "Explain LoRA in one sentence.",
]


def datum(tokens: list[int]) -> Datum:
    n = len(tokens) - 1
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                 loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(n, np.float32)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default=SMOLLM2_NAME)
    parser.add_argument("--steps", type=int, default=3, help="training steps before the adapter is compared")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.base_model == SMOLLM2_NAME:
        prepare_smollm2()
    started = time.monotonic()
    with LocalStack(args.base_model, Path(tempfile.mkdtemp(prefix="parity-")), num_threads=args.threads) as stack:
        stack.start()
        with stack.client() as client:
            tc = client.create_lora_training_client(args.base_model, rank=16, seed=0)
            tokenizer = tc.get_tokenizer()
            prompts = []
            for text in PROMPTS:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
                prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
            train = [datum(p + tokenizer.encode(" A short, made-up answer.")) for p in prompts]
            for _ in tqdm(range(args.steps), desc="train"):
                tc.forward_backward(train)
                tc.optim_step(AdamParams(learning_rate=1e-3, eps=1e-8))
            samplers = {"adapter": tc.save_weights_and_get_sampling_client("parity"),
                        "base": client.create_sampling_client(base_model=args.base_model)}
            base_run = client.create_lora_training_client(args.base_model, rank=1, seed=0)  # B = 0: the base model
            trainers = {"adapter": tc, "base": base_run}
            report = {}
            for name, sampler in samplers.items():
                sampled_diff, prompt_diff = 0.0, 0.0
                for prompt in tqdm(prompts, desc=f"compare ({name})"):
                    seq = sampler.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=args.max_tokens, seed=1)).result().sequences[0]
                    full = prompt + seq.tokens
                    trainer_lp = trainers[name].forward([datum(full)]).result().loss_fn_outputs[0]["logprobs"].to_numpy()
                    sampler_lp = np.array(sampler.compute_logprobs(ModelInput.from_ints(full)).result()[1:], dtype=np.float32)
                    prompt_diff = max(prompt_diff, float(np.abs(trainer_lp - sampler_lp).max()))
                    n = len(seq.tokens)
                    sampled_diff = max(sampled_diff, float(np.abs(trainer_lp[-n:] - np.asarray(seq.logprobs, np.float32)).max()))
                report[name] = {"compute_logprobs_vs_trainer": prompt_diff, "sampled_logprobs_vs_trainer": sampled_diff}
    worst = max(v for r in report.values() for v in r.values())
    print(json.dumps({"max_abs_diff": worst, "goal": 1e-4, "ok": worst <= 1e-4, **report,
                      "seconds": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
