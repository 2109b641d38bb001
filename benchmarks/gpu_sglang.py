"""The SGLang sampler on a GPU, through the real stack: sampler<->trainer logprob parity (bf16 and
fp32) and mixed-adapter decode throughput relative to base-model decode.

For each dtype a LocalStack starts (scheduler, CUDA trainer, sampler with TEMPER_SAMPLER_BACKEND=sglang),
trains ``--adapters`` LoRA adapters a few steps, and saves them for sampling. Then:
  parity      sample from each adapter and the base model; the trainer's forward logprobs of the
              same tokens vs the sampler's per-token logprobs and its compute_logprobs (max abs diff;
              both raw-model logprobs, Temper's default contract)
  throughput  (first dtype only) ``--requests`` concurrent samples of ``--max-tokens`` tokens on the
              base model, then the same spread round-robin over every adapter: decode tokens/s each;
              mixed_over_base = mixed / base, goal >= 0.8

    python benchmarks/gpu_sglang.py                 # SmolLM2-135M-Instruct, cuda, bf16 + fp32
    python benchmarks/gpu_sglang.py --dry-run       # CPU, tiny model, the fake sglang of tests/engine

--dry-run checks this script's own logic on a CPU: the sampler imports tests/engine/sglang_fake.py as
``sglang`` (a shim package on PYTHONPATH), so its numbers say nothing about SGLang. The result JSON
is the last stdout line (and --json-out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
GOALS = {"mixed_over_base": (">=", 0.8)}
SHIM = {  # the fake as an importable `sglang` package (dry run only)
    "sglang/__init__.py": "from sglang_fake import Engine, GenerateReqInput, LoRAUpdateOutput, __version__  # noqa: F401\n",
    "sglang/srt/__init__.py": "", "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/io_struct.py": "from sglang_fake import GenerateReqInput, LoRAUpdateOutput  # noqa: F401\n",
}


def datum(tokens: list[int]):
    from temper.client import Datum, ModelInput

    n = len(tokens) - 1
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                 loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(n, np.float32)})


def stack_env(args, dtype: str, scratch: Path) -> dict[str, str]:
    env = {"TEMPER_SAMPLER_BACKEND": "sglang", "TEMPER_SAMPLER_DTYPE": dtype, "TEMPER_TRAINER_DTYPE": dtype,
           "TEMPER_SAMPLER_DEVICE": args.device, "TEMPER_TRAINER_DEVICE": args.device,
           "TEMPER_SAMPLER_MAX_ADAPTERS": str(args.adapters + 1),
           "TEMPER_SAMPLER_SGLANG_MAX_LORAS_PER_BATCH": str(args.adapters + 1)}
    if args.dry_run:
        for rel, text in SHIM.items():
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            (scratch / rel).write_text(text)
        env["PYTHONPATH"] = f"{scratch}:{REPO / 'tests' / 'engine'}:{REPO}"
    return env


def train_adapters(client, args, prompts: list[list[int]], tokenizer) -> list:
    from temper.client import AdamParams

    clients = []
    for i in range(args.adapters):
        tc = client.create_lora_training_client(args.base_model, rank=args.rank, seed=i)
        answer = tokenizer.encode(f" Answer number {i}: a short, made-up reply.")
        data = [datum(p + answer) for p in prompts]
        for _ in range(args.steps):
            tc.forward_backward(data)
            tc.optim_step(AdamParams(learning_rate=1e-3, eps=1e-8))
        clients.append(tc)
    return clients


def parity(client, args, prompts, trainers) -> dict:
    from temper.client import ModelInput, SamplingParams

    pairs = [(f"adapter{i}", tc.save_weights_and_get_sampling_client(f"parity{i}"), tc) for i, tc in enumerate(trainers)]
    pairs.append(("base", client.create_sampling_client(base_model=args.base_model),
                  client.create_lora_training_client(args.base_model, rank=1, seed=0)))  # B = 0: the base model
    sampled, scored = 0.0, 0.0
    for _name, sampler, trainer in pairs:
        for prompt in prompts:
            seq = sampler.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=args.parity_tokens, seed=1)).result().sequences[0]
            full = prompt + list(seq.tokens)
            trainer_lp = trainer.forward([datum(full)]).result().loss_fn_outputs[0]["logprobs"].to_numpy()
            sampler_lp = np.array(sampler.compute_logprobs(ModelInput.from_ints(full)).result()[1:], dtype=np.float32)
            scored = max(scored, float(np.abs(trainer_lp - sampler_lp).max()))
            if seq.tokens:
                n = len(seq.tokens)
                sampled = max(sampled, float(np.abs(trainer_lp[-n:] - np.asarray(seq.logprobs, np.float32)).max()))
    return {"sampled_logprobs_vs_trainer": sampled, "compute_logprobs_vs_trainer": scored}


def decode_rate(samplers: list, prompt: list[int], args) -> float:
    """Tokens/s of ``--requests`` concurrent samples, round-robin over ``samplers``."""
    from temper.client import ModelInput, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])  # no stop: full length
    started = time.perf_counter()
    futures = [samplers[i % len(samplers)].sample(ModelInput.from_ints(prompt), 1, params) for i in range(args.requests)]
    tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
    return tokens / (time.perf_counter() - started)


def throughput(client, args, prompt, trainers) -> dict:
    base = client.create_sampling_client(base_model=args.base_model)
    adapters = [tc.save_weights_and_get_sampling_client(f"speed{i}") for i, tc in enumerate(trainers)]
    decode_rate([base], prompt, args)  # warm-up (CUDA graphs, caches)
    decode_rate(adapters, prompt, args)
    base_rate, mixed_rate = decode_rate([base], prompt, args), decode_rate(adapters, prompt, args)
    return {"base_tokens_per_s": round(base_rate, 1), "mixed_tokens_per_s": round(mixed_rate, 1),
            "mixed_over_base": round(mixed_rate / base_rate, 3), "adapters": len(adapters), "requests": args.requests,
            "max_tokens": args.max_tokens}


def run_dtype(args, dtype: str, measure_speed: bool) -> dict:
    from temper.localstack import LocalStack

    scratch = Path(tempfile.mkdtemp(prefix=f"gpu-sglang-{dtype}-"))
    started = time.monotonic()
    with LocalStack(args.base_model, scratch, extra_env=stack_env(args, dtype, scratch), num_threads=args.threads) as stack:
        stack.start(timeout=args.start_timeout)
        with stack.client() as client:
            trainers = [client.create_lora_training_client(args.base_model, rank=args.rank, seed=0)]
            tokenizer = trainers[0].get_tokenizer()
            prompts = [list(tokenizer.encode(text)) for text in ("What is the capital of France?", "List three prime numbers.")]
            trainers = train_adapters(client, args, prompts, tokenizer)
            out = {"dtype": dtype, **parity(client, args, prompts, trainers)}
            if measure_speed:
                out["throughput"] = throughput(client, args, prompts[0], trainers)
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default=None, help="default: SmolLM2-135M-Instruct (the tiny model with --dry-run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--parity-tokens", type=int, default=24)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, fake sglang: checks this script only")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if args.dry_run:
        from temper.services.models.tiny import build_tiny_model

        args.device = "cpu"
        args.base_model = args.base_model or str(build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-")) / "tiny"))
    elif args.base_model is None:
        from temper.services.models.prepare import SMOLLM2_NAME, prepare_smollm2

        args.base_model = SMOLLM2_NAME
        prepare_smollm2()
    dtypes = args.dtypes.split(",")
    runs = [run_dtype(args, dtype, measure_speed=(k == 0)) for k, dtype in enumerate(dtypes)]
    speed = runs[0].get("throughput", {})
    ratio = speed.get("mixed_over_base")
    result = {
        "benchmark": "gpu_sglang", "dry_run": args.dry_run, "base_model": args.base_model, "device": args.device,
        "parity_max_abs_diff": {r["dtype"]: max(r["sampled_logprobs_vs_trainer"], r["compute_logprobs_vs_trainer"]) for r in runs},
        "mixed_over_base": ratio, "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
        "goal_met": None if ratio is None else ratio >= GOALS["mixed_over_base"][1],
        "runs": runs, "python": platform.python_version(),
    }
    if args.dry_run:
        result["sglang"] = "fake (tests/engine/sglang_fake.py)"
    else:
        import sglang

        result["sglang"] = getattr(sglang, "__version__", "?")
    line = json.dumps(result)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
