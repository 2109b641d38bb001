"""Asynchronous GRPO-style RL on exactly-scored addition: the task, reward and advantages of
recipes/rl_arithmetic.py (its synchronous twin), with sampling and training overlapped through one
in-flight sampling client (docs/async_rl.md).

Sampler workers (threads) sample groups continuously from ONE in-flight sampling client
(``save_weights_and_get_sampling_client(kind="inflight")``) and queue them; the trainer takes
``--batch-prompts`` finished groups per step, trains (``importance_sampling``), and saves an in-flight
version after each step, which moves the client's target: later tokens, even of sequences already
decoding, come from the new weights. Every sampled token says which version produced it (the
sequence's version spans), so:

- staleness is per token: lag = the trainer's version − the token's version; tokens with lag >
  ``--max-lag`` are dropped (advantage 0) or, with ``--stale downweight``, halved per version past it;
- the importance correction is exact: the sampled logprobs are the behaviour logprobs of each token's
  own version, and the loss's ratio is exp(trainer − sampled);
- per step it logs the staleness histogram (tokens per lag), the sampler − trainer KL (mean of sampled
  − trainer logprob over the trained tokens, overall and by lag), reward and wall-clock time.

    python -m recipes.rl_arithmetic_async                       # SmolLM2-135M-Instruct, defaults
    python -m recipes.rl_arithmetic_async --max-lag 2 --stale downweight --pin

Writes runs/rl_arithmetic_async/{metrics.jsonl, async_rl.png, summary.json} and prints one final JSON
line. Held-out accuracy (greedy, on snapshot saves) is measured before training, every
``--eval-every`` steps and at the end.
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import threading
import time
from collections import Counter

from tqdm import tqdm

from recipes.async_rl_common import Group, build_batch, histogram_row, plot_async, step_stats, token_versions
from recipes.common import MetricsLog, add_common_args, finish, greedy_futures, local_client, mean
from recipes.rl_arithmetic import evaluate_from, problems, prompt_tokens, reward
from temper.client import AdamParams, ModelInput, SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, "rl_arithmetic_async", steps=20, learning_rate=2e-4)
    p.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt (G)")
    p.add_argument("--batch-prompts", type=int, default=8, help="groups trained per step")
    p.add_argument("--ahead", type=int, default=None,
                   help="groups sampled ahead of the trainer at most (default: --batch-prompts x --max-lag)")
    p.add_argument("--workers", type=int, default=None, help="sampler threads, one request each (default: --ahead)")
    p.add_argument("--max-lag", type=int, default=1, help="staleness bound: versions a token may lag the trainer's")
    p.add_argument("--stale", choices=["drop", "downweight"], default="drop", help="tokens past --max-lag")
    p.add_argument("--pin", action="store_true", help="pin each sequence to the version its request started on")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--low", type=int, default=2, help="smallest operand")
    p.add_argument("--high", type=int, default=30, help="largest operand")
    p.add_argument("--heldout", type=int, default=64, help="held-out (a, b) pairs, never trained on")
    p.add_argument("--eval-every", type=int, default=5)
    return p.parse_args(argv)


class Samplers:
    """``--workers`` threads, each sampling one group at a time from the shared in-flight client and
    queueing it. A worker takes a slot before it samples and the trainer frees the slots of the groups it
    takes: at most ``--ahead`` groups are sampled or waiting beyond what the trainer holds, so with
    ``--ahead`` <= ``--batch-prompts`` × ``--max-lag`` no sampled token lags past the bound."""

    def __init__(self, sampler, tokenizer, pairs, args):
        self.sampler, self.tokenizer, self.pairs, self.args = sampler, tokenizer, pairs, args
        self.ahead = args.ahead or args.batch_prompts * max(1, args.max_lag)
        self.queue: queue.Queue[Group] = queue.Queue()
        self.slots = threading.Semaphore(self.ahead)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._rng = random.Random(args.seed)
        self._count = 0
        self.threads = [threading.Thread(target=self._run, name=f"sampler-{i}", daemon=True)
                        for i in range(args.workers or self.ahead)]

    def start(self) -> "Samplers":
        for t in self.threads:
            t.start()
        return self

    def _next(self) -> tuple[int, int, int]:
        with self._lock:
            self._count += 1
            a, b = self._rng.choice(self.pairs)
            return a, b, self.args.seed * 1_000_003 + self._count * 1009

    def _run(self) -> None:
        args = self.args
        try:
            while not self.stop.is_set():
                if not self.slots.acquire(timeout=0.2):
                    continue
                a, b, seed = self._next()
                prompt = prompt_tokens(self.tokenizer, a, b)
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
                response = self.sampler.sample(ModelInput.from_ints(prompt), args.group_size, params, pin_version=args.pin).result()
                seqs = response.sequences
                rewards = [reward(self.tokenizer.decode(s.tokens, skip_special_tokens=True), a, b) for s in seqs]
                self.queue.put(Group(a, b, prompt, seqs, rewards, response.prompt_cache_hit_tokens, time.monotonic()))
        except BaseException as e:  # surfaced by take(): a dead worker must not hang the trainer
            self.errors.append(e)
            self.stop.set()

    def take(self, n: int) -> list[Group]:
        """The ``n`` oldest finished groups (waiting for them); their slots go back to the workers."""
        groups: list[Group] = []
        while len(groups) < n:
            if self.errors:
                raise RuntimeError(f"a sampler worker failed: {self.errors[0]!r}") from self.errors[0]
            try:
                groups.append(self.queue.get(timeout=0.2))
            except queue.Empty:
                continue
        for _ in groups:
            self.slots.release()
        return groups

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def main(argv=None, observer=None) -> int:
    """``observer`` (benchmarks/async_rl.py): ``observer.started(training, sampler)`` once the in-flight
    client exists, ``observer.stopping()`` before the workers stop."""
    args = parse_args(argv)
    started = time.monotonic()
    train_pairs, heldout_pairs = problems(args.low, args.high, args.heldout, args.seed)
    adam = AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    evals: list[tuple[int, float, float]] = []  # (step, held-out reward, elapsed seconds at the save)
    pending_eval = None
    spans_checked = 0

    with local_client(args) as client, MetricsLog(args.out_dir / "metrics.jsonl", started) as log:
        training = client.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed)
        tokenizer = training.get_tokenizer()

        def submit_eval(step: int):
            snapshot = training.save_weights_and_get_sampling_client(f"async-rl-eval-{step}")
            at = time.monotonic() - started
            return step, at, greedy_futures(snapshot, [prompt_tokens(tokenizer, a, b) for a, b in heldout_pairs], args.max_tokens)

        def collect_eval(pending) -> None:
            step, at, futures = pending
            acc, _ = evaluate_from(futures, tokenizer, heldout_pairs)
            evals.append((step, acc, at))
            log.write(kind="eval", step=step, heldout_reward=acc, weights_elapsed_s=round(at, 1))

        pending_eval = submit_eval(0)
        sampler = training.save_weights_and_get_sampling_client(kind="inflight")
        version = sampler.min_version  # the target when the client was made: this save
        first_version = version
        workers = Samplers(sampler, tokenizer, train_pairs, args).start()
        if observer is not None:
            observer.started(training, sampler)
        bar = tqdm(total=args.steps, desc="async rl", unit="step")
        try:
            for step in range(1, args.steps + 1):
                t_wait = time.monotonic()
                groups = workers.take(args.batch_prompts)
                wait_s = time.monotonic() - t_wait
                for g in groups:
                    for s in g.sequences:
                        token_versions(s)  # raises unless the spans cover every token, in order
                        spans_checked += 1
                batch = build_batch(groups, version, args.max_lag, args.stale)
                row = {"step": step, "version": version, "train_reward": mean(batch.rewards), "groups": len(groups),
                       "groups_skipped": batch.groups_skipped, "datums": len(batch.data),
                       "staleness": histogram_row(batch.histogram), "tokens_dropped": batch.tokens_dropped,
                       "sequences_mixed": batch.sequences_mixed, "cache_hit_tokens": sum(g.cache_hit_tokens for g in groups),
                       "prompt_tokens": sum(len(g.prompt) for g in groups), "wait_s": round(wait_s, 3)}
                t_train = time.monotonic()
                if batch.data:
                    fb = training.forward_backward(batch.data, "importance_sampling")
                    opt = training.optim_step(adam)  # submitted before waiting: same scheduler cycle
                    output = fb.result()
                    opt.result()
                    row["loss"] = output.metrics.get("loss:sum")
                    row.update(step_stats(batch, output, args.max_lag))
                    row["train_s"] = round(time.monotonic() - t_train, 3)
                    t_save = time.monotonic()
                    version = training.save_weights_inflight().result().version  # moves the workers' client too
                    row["save_s"] = round(time.monotonic() - t_save, 3)
                    row["saved_version"], row["saved_unix_us"] = version, int(time.time() * 1e6)  # answered (int: the log rounds floats)
                if pending_eval is not None and (pending_eval[0] < step - 1 or all(f.done() for f in pending_eval[2])):
                    collect_eval(pending_eval)
                    pending_eval = None
                if pending_eval is None and step % args.eval_every == 0 and step < args.steps:
                    pending_eval = submit_eval(step)
                log.write(kind="train", **row)
                bar.set_postfix(reward=f"{row['train_reward']:.2f}", v=version, lag=max(map(int, row["staleness"]), default=0))
                bar.update()
        finally:
            if observer is not None:
                observer.stopping()
            workers.close()
            bar.close()
        if pending_eval is not None:
            collect_eval(pending_eval)
        collect_eval(submit_eval(args.steps))

    train_rows = [r for r in log.rows if r["kind"] == "train"]
    total = Counter()
    for r in train_rows:
        total.update({int(k): v for k, v in r["staleness"].items()})
    plot = args.out_dir / "async_rl.png"
    plot_async(plot, f"Asynchronous RL arithmetic (max lag {args.max_lag}, {args.stale}): held-out {evals[0][1]:.2f} → {evals[-1][1]:.2f}",
               train_rows, [(at, acc) for _, acc, at in evals])
    kls = [r["kl_sample_train"] for r in train_rows if "kl_sample_train" in r]
    lag0 = [r["lag0_abs_diff_max"] for r in train_rows if r.get("lag0_abs_diff_max") is not None]
    summary = {
        "recipe": "rl_arithmetic_async", "heldout_reward_before": round(evals[0][1], 4), "heldout_reward_after": round(evals[-1][1], 4),
        "evals": [[s, round(a, 4)] for s, a, _ in evals], "steps": args.steps,
        "train_reward_first": round(train_rows[0]["train_reward"], 4) if train_rows else None,
        "train_reward_last5": round(mean(r["train_reward"] for r in train_rows[-5:]), 4) if train_rows else None,
        "first_version": first_version, "last_version": version, "staleness": histogram_row(total),
        "max_lag": args.max_lag, "stale": args.stale, "pin": args.pin, "tokens_dropped": sum(r["tokens_dropped"] for r in train_rows),
        "sequences_mixed": sum(r["sequences_mixed"] for r in train_rows), "sequences_checked": spans_checked,
        "kl_sample_train_mean": round(mean(kls), 8) if kls else None, "lag0_abs_diff_max": max(lag0) if lag0 else None,
        "cache_hit_rate": round(sum(r["cache_hit_tokens"] for r in train_rows) / max(1, sum(r["prompt_tokens"] for r in train_rows)), 4),
        "train_seconds": round(train_rows[-1]["elapsed_s"] - train_rows[0]["elapsed_s"], 1) if len(train_rows) > 1 else None,
        "group_size": args.group_size, "batch_prompts": args.batch_prompts, "workers": len(workers.threads), "ahead": workers.ahead,
        "learning_rate": args.learning_rate, "heldout": len(heldout_pairs), "seconds": round(time.monotonic() - started, 1),
        "plot": str(plot), "metrics": str(args.out_dir / "metrics.jsonl"),
    }
    return finish(summary, args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
