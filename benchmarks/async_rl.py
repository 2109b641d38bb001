"""Asynchronous vs synchronous RL on CPU (issue 31): the arithmetic recipe twice on one local stack,
side by side in one run, with the same task, batch and learning rate:

- synchronous: recipes/rl_arithmetic.py (sample a batch, then train on it, then save and sample again);
- asynchronous: recipes/rl_arithmetic_async.py (sampler threads on one in-flight client while the
  trainer steps; max version lag 1 per token, older tokens dropped).

Figures (printed as one JSON line, written to results/async_rl.json, plotted to results/async_rl.png):

- ``steps_per_hour_ratio``: async ÷ sync steps per hour, each from its steady-state step period (the
  wall-clock between its first and last trained step ÷ the steps between; the step-0 evaluation and
  start-up are outside it). Goal >= 1.25 at equal held-out reward within noise (both evaluate the same
  held-out pairs greedily at the end; "within noise" = |difference| <= 2 binomial standard errors).
- ``switch_ratio``: the time from an in-flight save's answer to the first sampled token whose version
  span names the new version ÷ a training step (the async run's median forward_backward + optim_step).
  Measured by a probe streaming one sequence at a time (SampleStream) on the recipe's in-flight client
  while it trains. Goal <= 0.05.
- prefix-cache hit rate: the async run's prompt tokens served from its client's cache
  (SampleResponse.prompt_cache_hit_tokens) ÷ its prompt tokens; and a group of ``--group-size``
  requests of one prompt on a fresh client (the later ones should hit all but the last prompt token),
  with the first (cold) and later (warm) request times.

    python benchmarks/async_rl.py                            # SmolLM2-135M-Instruct, 12 steps each, 1 thread per service
    python benchmarks/async_rl.py --threads 2 --steps 20     # sampler and trainer sharing both cores
    python benchmarks/async_rl.py --quick --model <tiny dir> # the smoke test's run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # recipes/ (run as a script from anywhere)

from recipes import rl_arithmetic, rl_arithmetic_async  # noqa: E402
from recipes.rl_arithmetic import prompt_tokens  # noqa: E402
from temper.client import ModelInput, SamplingParams, ServiceClient, convert  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402
from temper.services.models.prepare import SMOLLM2_NAME  # noqa: E402
from temper.v1 import service_pb2  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2_NAME)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per service (1: the trainer and the sampler each on a core of their own, as on separate devices)")
    p.add_argument("--device", default="cpu", help="torch device of the trainer and sampler: cuda on a GPU machine (benchmarks/gpu_async_rl.sh)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="base model dtype of both services")
    p.add_argument("--probe-tokens", type=int, default=32, help="tokens per streamed probe sequence")
    p.add_argument("--quick", action="store_true", help="3 steps, groups of 4, 2 prompts, 4 held-out: a smoke run")
    p.add_argument("--parity-reward", action="store_true",
                   help="reward = the completion's length parity, so every step trains on any model (--quick sets it: the "
                        "tiny model never answers a sum, and with all-equal rewards nothing trains or saves)")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.group_size, args.batch_prompts, args.heldout, args.max_tokens = 3, 4, 2, 4, 4
        args.threads, args.probe_tokens, args.parity_reward = 1, 8, True
    return args


class SwitchProbe:
    """Streams one sequence at a time on the recipe's in-flight client and records when each version's
    first token arrived (time.time(), comparable with the recipe's ``saved_unix_us``)."""

    def __init__(self, prompt: list[int], max_tokens: int):
        self.prompt, self.max_tokens = prompt, max_tokens
        self.first_seen: dict[int, float] = {}
        self.stop = threading.Event()
        self.future = None
        self.errors: list[BaseException] = []

    def started(self, training, sampler) -> None:
        self.future = sampler._runtime.call_soon(self._loop(sampler))

    def stopping(self) -> None:
        self.stop.set()
        if self.future is not None:
            self.future.result(timeout=120)

    async def _loop(self, sampler) -> None:
        runtime = sampler._runtime
        params = convert.sampling_params_to_proto(SamplingParams(max_tokens=self.max_tokens, temperature=1.0))
        prompt = convert.model_input_to_proto(ModelInput.from_ints(self.prompt))
        try:
            while not self.stop.is_set():
                request = service_pb2.SampleRequest(sampler_id=sampler.sampler_id, prompt=prompt, num_samples=1, sampling_params=params)
                async for chunk in runtime.stub.SampleStream(request, metadata=runtime.metadata):
                    now = time.time()
                    for piece in chunk.pieces:
                        for span in piece.versions:
                            self.first_seen.setdefault(int(span.weights.version), now)
        except BaseException as e:  # reported, not raised into the recipe
            self.errors.append(e)


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_period(train_rows: list[dict]) -> float:
    """Steady-state seconds per step: from the first trained step's row to the last's."""
    return (train_rows[-1]["elapsed_s"] - train_rows[0]["elapsed_s"]) / max(1, len(train_rows) - 1)


def within_noise(p1: float, p2: float, n: int) -> tuple[bool, float]:
    se = math.sqrt(max(p1 * (1 - p1), 1.0 / n) / n + max(p2 * (1 - p2), 1.0 / n) / n)
    return abs(p1 - p2) <= 2 * se, round(2 * se, 4)


def group_cache_probe(client: ServiceClient, model: str, tokenizer, group: int, max_tokens: int) -> dict:
    """``group`` requests of one prompt, one after another, on a fresh base-model client: hit tokens and times."""
    sampler = client.create_sampling_client(base_model=model)
    prompt = prompt_tokens(tokenizer, 17, 25)
    hits, seconds = [], []
    for i in range(group):
        t = time.perf_counter()
        r = sampler.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i)).result()
        seconds.append(time.perf_counter() - t)
        hits.append(r.prompt_cache_hit_tokens)
    later = hits[1:]
    return {"prompt_tokens": len(prompt), "hit_tokens": hits, "later_hit_rate": round(sum(later) / max(1, len(later) * len(prompt)), 4),
            "cold_s": round(seconds[0], 4), "warm_s_median": round(statistics.median(seconds[1:]), 4) if group > 1 else None}


def plot(path: Path, sync_rows, async_rows, result) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_p, ax_h, ax_s) = plt.subplots(1, 4, figsize=(21, 4))
    for name, rows in (("synchronous", sync_rows), ("asynchronous", async_rows)):
        ax_r.plot([r["elapsed_s"] for r in rows], [r["train_reward"] for r in rows], marker="o", ms=3, label=f"{name}, train")
    ax_r.set(xlabel="wall-clock seconds", ylabel="mean exact reward",
             title=f"held-out after: sync {result['heldout']['sync_after']:.2f}, async {result['heldout']['async_after']:.2f}")
    ax_p.bar(["sync", "async"], [3600 / result["sync"]["step_period_s"], 3600 / result["async"]["step_period_s"]], color=["tab:blue", "tab:orange"])
    ax_p.set(ylabel="steps per hour", title=f"async / sync = {result['steps_per_hour_ratio']:.2f} (goal >= 1.25)")
    hist = result["async"]["staleness"]
    ax_h.bar(list(hist), list(hist.values()), color="tab:purple")
    ax_h.set(xlabel="version lag of sampled tokens", ylabel="tokens", title="async staleness")
    lat = result["switch"]["latencies_s"]
    ax_s.plot(list(range(len(lat))), lat, marker="o", ms=3, label="save answered → first token on it")
    ax_s.axhline(result["switch"]["train_step_s"], color="grey", ls="--", label="training step (fb + optim)")
    ax_s.set(xlabel="in-flight save", ylabel="seconds", title=f"switch / step = {result['switch_ratio']} (goal <= 0.05)")
    for ax in (ax_r, ax_s):
        ax.legend(fontsize=8)
    for ax in (ax_r, ax_p, ax_h, ax_s):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model == SMOLLM2_NAME:
        from temper.services.models.prepare import prepare_smollm2

        prepare_smollm2()
    if args.parity_reward:
        for module in (rl_arithmetic, rl_arithmetic_async):
            module.reward = lambda text, a, b: float(len(text) % 2)
    work = Path(tempfile.mkdtemp(prefix="async-rl-bench-"))
    common = ["--base-model", args.model, "--steps", str(args.steps), "--group-size", str(args.group_size),
              "--batch-prompts", str(args.batch_prompts), "--max-tokens", str(args.max_tokens), "--heldout", str(args.heldout),
              "--eval-every", str(args.steps), "--learning-rate", str(args.learning_rate)]
    devices = {f"TEMPER_{role}_{key}": value for role in ("TRAINER", "SAMPLER")
               for key, value in (("DEVICE", args.device), ("DTYPE", args.dtype))}
    with LocalStack(args.model, work / "stack", num_threads=args.threads, extra_env=devices) as stack:
        address = stack.start()
        os.environ["TEMPER_API_KEY"] = stack.api_key  # the recipes' --address client reads it
        common += ["--address", address]
        stdout = sys.stdout
        sys.stdout = sys.stderr  # the recipes' own JSON lines: this script's last stdout line is its result
        try:
            rl_arithmetic.main([*common, "--out-dir", str(work / "sync")])
            with ServiceClient(address) as client:
                tokenizer = client.create_sampling_client(base_model=args.model).get_tokenizer()
                probe = SwitchProbe(prompt_tokens(tokenizer, 12, 9), args.probe_tokens)
                rl_arithmetic_async.main([*common, "--out-dir", str(work / "async"), "--max-lag", "1"], observer=probe)
                cache_group = group_cache_probe(client, args.model, tokenizer, args.group_size, args.max_tokens)
        finally:
            sys.stdout = stdout
    sync_summary = json.loads((work / "sync" / "summary.json").read_text())
    async_summary = json.loads((work / "async" / "summary.json").read_text())
    sync_rows = [r for r in read_rows(work / "sync") if r["kind"] == "train"]
    async_rows = [r for r in read_rows(work / "async") if r["kind"] == "train"]

    saved = {r["saved_version"]: r["saved_unix_us"] / 1e6 for r in async_rows if "saved_version" in r}
    latencies = [round(probe.first_seen[v] - t, 4) for v, t in sorted(saved.items()) if v in probe.first_seen]
    train_steps = [r["train_s"] for r in async_rows if "train_s" in r]
    train_step = statistics.median(train_steps) if train_steps else float("nan")
    sync_period, async_period = step_period(sync_rows), step_period(async_rows)
    equal, noise = within_noise(sync_summary["heldout_reward_after"], async_summary["heldout_reward_after"], sync_summary["heldout"])
    prompt_tokens_total = sum(r["prompt_tokens"] for r in async_rows)
    result = {
        "benchmark": "async_rl", "model": args.model, "quick": args.quick, "parity_reward": args.parity_reward, "steps": args.steps, "group_size": args.group_size,
        "batch_prompts": args.batch_prompts, "threads": args.threads, "device": args.device, "dtype": args.dtype, "cpu_count": os.cpu_count(),
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "steps_per_hour_ratio": round(sync_period / async_period, 3),
        "switch_ratio": round(statistics.median(latencies) / train_step, 4) if latencies else None,
        "sync": {"step_period_s": round(sync_period, 3), "steps_per_hour": round(3600 / sync_period, 1),
                 "seconds": sync_summary["seconds"]},
        "async": {"step_period_s": round(async_period, 3), "steps_per_hour": round(3600 / async_period, 1),
                  "seconds": async_summary["seconds"], "staleness": async_summary["staleness"],
                  "tokens_dropped": async_summary["tokens_dropped"], "sequences_mixed": async_summary["sequences_mixed"],
                  "kl_sample_train_mean": async_summary["kl_sample_train_mean"], "lag0_abs_diff_max": async_summary["lag0_abs_diff_max"],
                  "median_wait_s": round(statistics.median(r["wait_s"] for r in async_rows), 3)},
        "heldout": {"n": sync_summary["heldout"], "sync_before": sync_summary["heldout_reward_before"],
                    "sync_after": sync_summary["heldout_reward_after"], "async_before": async_summary["heldout_reward_before"],
                    "async_after": async_summary["heldout_reward_after"], "equal_within_noise": equal, "two_se": noise},
        "switch": {"latencies_s": latencies, "median_s": round(statistics.median(latencies), 4) if latencies else None,
                   "train_step_s": round(train_step, 3), "versions_saved": len(saved), "versions_seen": len(latencies),
                   "probe_errors": [repr(e) for e in probe.errors]},
        "prefix_cache": {"async_run_hit_rate": round(sum(r["cache_hit_tokens"] for r in async_rows) / max(1, prompt_tokens_total), 4),
                         "async_run_prompt_tokens": prompt_tokens_total, "group_as_requests": cache_group},
        "goals": {"steps_per_hour_ratio": ">= 1.25 at equal held-out reward", "switch_ratio": "<= 0.05"},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "async_rl" + ("" if args.device == "cpu" else f"_{args.device.split(':')[0]}")  # a GPU run keeps the CPU figures
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(args.out_dir / f"{name}.png", sync_rows, async_rows, result)
    print(f"steps/hour async/sync {result['steps_per_hour_ratio']} (goal >= 1.25; held-out sync {equal and 'equal' or 'DIFFERENT'}: "
          f"{result['heldout']['sync_after']} vs {result['heldout']['async_after']}); switch/step {result['switch_ratio']} (goal <= 0.05); "
          f"cache hit rate {result['prefix_cache']['async_run_hit_rate']}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
