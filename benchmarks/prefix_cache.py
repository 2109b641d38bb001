"""The torch sampler's prompt-prefix cache (services/sampler/prefix_cache.py), side by side in one
process on one loaded model: an RL group sent as 8 requests of one prompt, and as one request of 8
samples, each decoded three ways:

- batched: the left-padded batched prefill, every row's prompt prefilled (no per-prompt path);
- per_prompt: each prompt prefilled once, alone, no cache (prefix_cache_bytes=0);
- cached: per prompt, through the prefix cache (a session's later requests prefill 1 token).

Prints one JSON line (and writes it to benchmarks/results/prefix_cache.json): median seconds per
scenario, prompt tokens served from the cache, and the greedy tokens' agreement with batched.

    .venv/bin/python -m benchmarks.prefix_cache --prompt-tokens 512 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from temper.services.models.loading import load_model
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.prefix_cache import PrefixCache
from temper.services.sampler.torch_backend import TorchSamplerBackend

MODES = ("batched", "per_prompt", "cached")


def configure(backend: TorchSamplerBackend, mode: str, budget: int) -> None:
    backend.prompt_prefill = mode != "batched"
    backend.prefix_cache = PrefixCache(budget if mode == "cached" else 0)  # a fresh, empty cache per run


def run(backend, mode, budget, prompt, group, options, as_requests: bool, session: str):
    configure(backend, mode, budget)
    started = time.perf_counter()
    if as_requests:  # RL sends the group's prompt in several requests (one per sample)
        results = [backend.sample_batch([SampleRequest(None, prompt, 1, options, cache_session=session, tenant="bench")])[0]
                   for _ in range(group)]
    else:
        results = backend.sample_batch([SampleRequest(None, prompt, group, options, cache_session=session, tenant="bench")])
    seconds = time.perf_counter() - started
    tokens = [s.tokens for r in results for s in r.sequences]
    return seconds, sum(r.prompt_cache_hit_tokens for r in results), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_cache.json"))
    args = parser.parse_args()
    backend = TorchSamplerBackend(load_model(args.model, args.device), args.device)
    prompt = np.random.default_rng(0).integers(10, backend.loaded.vocab_size - 10, args.prompt_tokens).astype(np.int32)
    options = SamplingOptions(max_tokens=args.max_tokens, temperature=0.0, stop_disabled=True)
    budget = 1 << 30
    report = {"model": args.model, "device": args.device, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "group": args.group, "repeats": args.repeats}
    for scenario, as_requests in (("group_as_requests", True), ("group_in_one_request", False)):
        seconds = {m: [] for m in MODES}
        hits, agree = {}, {}
        for repeat in range(args.repeats):  # modes interleaved, so drift in the machine's load hits each alike
            reference = None
            for mode in MODES:
                s, hit, tokens = run(backend, mode, budget, prompt, args.group, options, as_requests, f"{scenario}-{repeat}")
                seconds[mode].append(s)
                hits[mode] = hit
                reference = tokens if mode == "batched" else reference
                agree[mode] = tokens == reference
        report[scenario] = {m: {"median_s": round(statistics.median(seconds[m]), 4), "hit_tokens": hits[m],
                                "greedy_equal_to_batched": agree[m]} for m in MODES}
        report[scenario]["speedup_cached_vs_batched"] = round(
            statistics.median(seconds["batched"]) / statistics.median(seconds["cached"]), 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
