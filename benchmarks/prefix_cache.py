"""The torch sampler's prefill and prompt-prefix cache (services/sampler/prompt_prefill.py,
prefix_cache.py), side by side in one process per model (SmolLM2-135M and the tiny test model):

Prefill throughput (max_tokens=1, so a call is its prefill and one sampled token), for (a) 8 distinct
prompts x 1 sample, (b) 1 prompt x 8 samples, (c) 16 short prompts, four ways, interleaved:
- batched: the old left-padded prefill of every row (``prompt_prefill`` off, as vision models run);
- per_request: each distinct missed prompt alone, one forward each (964b09d's prefill), cache on;
- together: the distinct missed prompts in one left-padded forward, each row's KV sliced into the
  cache (today's path), a fresh session each call (all misses, stores included);
- no_session: today's path for requests that name no session (the cache never consulted).
Ratios are seconds / batched's seconds (below 1: faster), medians over --repeats.

(d) 8 distinct prompts over a session's cached system prompt (partial hits): batched without
cache, per_request (each rest alone), together (the rests in one forward over the cached prefixes).

Group sampling: 8 requests of one prompt in one session (the prompt prefilled once, 7 full hits) and
without a session; 1 request x 8 samples (one row prefilled) against batched (8 rows).

Numerics: a full hit's tokens and logprobs equal the miss before it bit for bit (sampled, seeded);
a partial hit (a second turn over the first turn's cached KV) against the batched prefill without
cache: greedy tokens equal and the largest |logprob difference| (the bound the docs state), next to
the same prompt prefilled uncached by today's path against the batched prefill (two layouts of one
computation: the float32 rounding any prefill change brings).

Writes benchmarks/results/prefix_cache.json (and .png when matplotlib is present).

    .venv/bin/python -m benchmarks.prefix_cache            # both models, ~3 minutes on 1 CPU thread
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from itertools import count
from pathlib import Path

import numpy as np
import torch

from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.prefix_cache import PrefixCache
from temper.services.sampler.torch_backend import TorchSamplerBackend

HERE = Path(__file__).resolve().parent
MODES = ("batched", "per_request", "together", "no_session")
ONE_TOKEN = SamplingOptions(max_tokens=1, temperature=1.0, seed=1, stop_disabled=True)
BUDGET = 1 << 30
_sessions = count()


def configure(backend: TorchSamplerBackend, mode: str) -> None:
    backend.prompt_prefill = mode != "batched"
    backend.batch_missed_prompts = mode != "per_request"
    backend.prefix_cache = PrefixCache(BUDGET)  # empty each call: every prompt a miss


def requests_for(mode: str, prompts: list[np.ndarray], samples: int, options=ONE_TOKEN, session: str | None = None):
    session = "" if mode == "no_session" else session or f"s{next(_sessions)}"
    return [SampleRequest(None, p, samples, options, cache_session=session, tenant="bench" if session else "")
            for p in prompts]


def timed(backend, mode, prompts, samples) -> float:
    configure(backend, mode)
    batch = requests_for(mode, prompts, samples)
    started = time.perf_counter()
    backend.sample_batch(batch)
    return time.perf_counter() - started


def scenarios(rng, vocab: int, prompt_tokens: int, short_tokens: int) -> dict[str, tuple[list[np.ndarray], int]]:
    def draw(n):
        return rng.integers(10, vocab - 10, n).astype(np.int32)

    lengths = rng.integers(prompt_tokens // 2, prompt_tokens + 1, 8)
    return {"a_8_prompts_x1": ([draw(n) for n in lengths], 1),
            "b_1_prompt_x8": ([draw(prompt_tokens)], 8),
            "c_16_short_prompts": ([draw(n) for n in rng.integers(short_tokens // 2, short_tokens + 1, 16)], 1)}


def prefill_throughput(backend, cases, repeats: int) -> dict:
    out = {}
    for name, (prompts, samples) in cases.items():
        for mode in MODES:  # warm-up (allocator, kernels' first-call costs)
            timed(backend, mode, prompts, samples)
        seconds = {m: [] for m in MODES}
        for _ in range(repeats):  # modes interleaved, so drift in the machine's load hits each alike
            for mode in MODES:
                seconds[mode].append(timed(backend, mode, prompts, samples))
        base = statistics.median(seconds["batched"])
        out[name] = {"median_s": {m: round(statistics.median(s), 5) for m, s in seconds.items()},
                     "ratio_to_batched": {m: round(statistics.median(s) / base, 3) for m, s in seconds.items()}}
    return out


def shared_prefix(backend, rng, vocab: int, prompt_tokens: int, repeats: int) -> dict:
    """(d) an RL step in a session that has cached its system prompt: 8 distinct prompts extending it (8
    partial hits: one forward of their rests over the cached prefix, or one forward each) against the
    batched prefill of the whole prompts without cache."""
    system = rng.integers(10, vocab - 10, prompt_tokens // 2).astype(np.int32)
    prompts = [np.concatenate([system, rng.integers(10, vocab - 10, n).astype(np.int32)])
               for n in rng.integers(prompt_tokens // 4, prompt_tokens // 2 + 1, 8)]
    modes = ("batched", "per_request", "together")
    seconds, hits = {m: [] for m in modes}, 0
    for repeat in range(repeats + 1):  # the first round warms up
        for mode in modes:
            configure(backend, mode)
            session = f"sys{next(_sessions)}"
            if mode != "batched":
                backend.sample_batch(requests_for(mode, [system], 1, session=session))
            batch = requests_for(mode, prompts, 1, session=session)
            started = time.perf_counter()
            results = backend.sample_batch(batch)
            if repeat:
                seconds[mode].append(time.perf_counter() - started)
            hits = sum(r.prompt_cache_hit_tokens for r in results) if mode == "together" else hits
    base = statistics.median(seconds["batched"])
    return {"system_tokens": len(system), "prompt_tokens": sum(map(len, prompts)), "hit_tokens": hits,
            "median_s": {m: round(statistics.median(v), 5) for m, v in seconds.items()},
            "ratio_to_batched": {m: round(statistics.median(v) / base, 3) for m, v in seconds.items()}}


def group_sampling(backend, prompt: np.ndarray, group: int, repeats: int) -> dict:
    """An RL group: ``group`` requests of one prompt (one session vs none), and one request of ``group`` samples."""
    as_requests = {"session": [], "no_session": []}
    hits = lookups = 0
    for _ in range(repeats):
        for mode, session in (("session", f"g{next(_sessions)}"), ("no_session", "")):
            configure(backend, "together")
            started = time.perf_counter()
            results = [backend.sample_batch([SampleRequest(None, prompt, 1, ONE_TOKEN, cache_session=session,
                                                           tenant="bench" if session else "")])[0] for _ in range(group)]
            as_requests[mode].append(time.perf_counter() - started)
            if session:
                hits, lookups = sum(r.prompt_cache_hit_tokens > 0 for r in results), len(results)
                hit_tokens = sum(r.prompt_cache_hit_tokens for r in results)
    one = {"batched": [], "together": []}
    for _ in range(repeats):
        for mode in one:
            one[mode].append(timed(backend, mode, [prompt], group))
    s, ns = statistics.median(as_requests["session"]), statistics.median(as_requests["no_session"])
    return {"requests_of_one_prompt": {"group": group, "hit_rate": round(hits / lookups, 3),
                                       "prompt_tokens_from_cache": hit_tokens, "prompt_tokens": group * len(prompt),
                                       "prompt_prefills": group - hits, "median_s": {"session": round(s, 5),
                                                                                      "no_session": round(ns, 5)},
                                       "time_ratio_session_to_no_session": round(s / ns, 3)},
            "one_request_of_group_samples": {"rows_prefilled": {"batched": group, "together": 1},
                                             "median_s": {m: round(statistics.median(v), 5) for m, v in one.items()},
                                             "time_ratio_together_to_batched": round(
                                                 statistics.median(one["together"]) / statistics.median(one["batched"]), 3)}}


def numerics(backend, rng, vocab: int, prompt_tokens: int, turns: int) -> dict:
    """A full hit against its miss (bits), and a partial hit against the batched prefill without cache."""
    base = rng.integers(10, vocab - 10, prompt_tokens).astype(np.int32)
    sampled = SamplingOptions(max_tokens=8, temperature=0.9, seed=3, stop_disabled=True)
    configure(backend, "together")
    first, again = (backend.sample_batch(requests_for("together", [base], 4, sampled, "bits"))[0] for _ in range(2))
    bit_identical = again.prompt_cache_hit_tokens == len(base) and all(
        a.tokens == b.tokens and np.array_equal(np.float32(a.logprobs), np.float32(b.logprobs))
        for a, b in zip(first.sequences, again.sequences))
    greedy = SamplingOptions(max_tokens=8, temperature=0.0, stop_disabled=True)
    worst, layout, tokens_equal, hit = 0.0, 0.0, True, 0
    for turn in range(turns):
        start = rng.integers(10, vocab - 10, prompt_tokens).astype(np.int32)
        configure(backend, "together")
        first = backend.sample_batch(requests_for("together", [start], 1, greedy, f"turns-{turn}"))[0]
        extended = np.concatenate([start, np.int32(first.sequences[0].tokens), rng.integers(10, vocab - 10, 32).astype(np.int32)])
        got = backend.sample_batch(requests_for("together", [extended], 1, greedy, f"turns-{turn}"))[0]
        alone = backend.sample_batch(requests_for("together", [extended], 1, greedy))[0]  # a fresh session: uncached
        hit = got.prompt_cache_hit_tokens
        configure(backend, "batched")
        want = backend.sample_batch(requests_for("batched", [extended], 1, greedy))[0]
        tokens_equal &= got.sequences[0].tokens == want.sequences[0].tokens
        worst = max(worst, _max_diff(got, want))
        layout = max(layout, _max_diff(alone, want))
    return {"full_hit_bit_identical": bool(bit_identical), "partial_hit_tokens": hit, "turns": turns,
            "partial_hit_greedy_tokens_equal": bool(tokens_equal), "partial_hit_max_abs_logprob_diff": worst,
            "uncached_prefill_vs_batched_max_abs_logprob_diff": layout}


def _max_diff(a, b) -> float:
    return float(np.abs(np.float64(a.sequences[0].logprobs) - np.float64(b.sequences[0].logprobs)).max())


def bench_model(name: str, path: str, args) -> dict:
    from temper.services.models.loading import load_model

    backend = TorchSamplerBackend(load_model(path, "cpu", "float32", args.threads), "cpu", prefix_cache_bytes=BUDGET)
    rng = np.random.default_rng(0)
    vocab = backend.loaded.vocab_size
    cases = scenarios(rng, vocab, args.prompt_tokens, args.short_tokens)
    report = {"model": name, "prefill": prefill_throughput(backend, cases, args.repeats),
              "d_8_prompts_over_a_cached_system_prompt": shared_prefix(backend, rng, vocab, args.prompt_tokens, args.repeats),
              "group_sampling": group_sampling(backend, cases["b_1_prompt_x8"][0][0], 8, args.repeats),
              "numerics": numerics(backend, rng, vocab, args.prompt_tokens, args.turns)}
    print(f"\n{name}: seconds / batched (median of {args.repeats}; below 1 = faster)")
    print(f"  {'case':22s}" + "".join(f"{m:>13s}" for m in MODES))
    for case, row in report["prefill"].items():
        print(f"  {case:22s}" + "".join(f"{row['ratio_to_batched'][m]:13.3f}" for m in MODES))
    d = report["d_8_prompts_over_a_cached_system_prompt"]
    print(f"  {'d_8_over_cached_prefix':22s}{1.0:13.3f}" + "".join(f"{d['ratio_to_batched'][m]:13.3f}" for m in MODES[1:3])
          + f"   ({d['hit_tokens']} of {d['prompt_tokens']} prompt tokens from the cache)")
    g = report["group_sampling"]
    print(f"  group of 8 requests: hit rate {g['requests_of_one_prompt']['hit_rate']}, session / no session "
          f"{g['requests_of_one_prompt']['time_ratio_session_to_no_session']}; 1 request x 8: together / batched "
          f"{g['one_request_of_group_samples']['time_ratio_together_to_batched']}")
    print(f"  numerics: {report['numerics']}")
    return report


def plot(report: dict, out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = {**m["prefill"], "d_8_over_cached_prefix": m["d_8_prompts_over_a_cached_system_prompt"]}
        cases = list(rows)
        width = 0.8 / len(MODES)
        for i, mode in enumerate(MODES):
            ax.bar(np.arange(len(cases)) + i * width, [rows[c]["ratio_to_batched"].get(mode, np.nan) for c in cases], width,
                   label=mode)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases, fontsize=8)
        ax.set_ylabel("seconds / batched")
        ax.set_title(f"{m['model']}: prefill (max_tokens=1)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or name (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny model")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=8, help="multi-turn prompts for the partial-hit bound")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "prefix_cache.json")
    args = parser.parse_args(argv)
    from benchmarks import harness
    from temper.services.models.tiny import build_tiny_model

    harness.resolve_model(args)
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    models = [bench_model(args.model, args.model, args)]
    if not args.no_tiny:
        tiny = build_tiny_model(Path(tempfile.mkdtemp(prefix="prefix-bench-")) / "tiny")
        models.append(bench_model("tiny (qwen3, 2 layers, 64 wide)", str(tiny), args))
    report = {"command": "python -m benchmarks.prefix_cache", "args": {k: str(v) for k, v in vars(args).items()},
              "threads": args.threads, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "seconds": round(time.perf_counter() - started, 1), "models": models}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
