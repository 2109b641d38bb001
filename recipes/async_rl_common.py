"""The asynchronous RL recipe's bookkeeping (recipes/rl_arithmetic_async.py), no model and no stack:
per-token weights versions from a sampled sequence's spans, the staleness bound (max version lag per
token: drop or down-weight), importance-sampling datums whose behaviour logprobs are the sampled ones,
the per-step statistics (staleness histogram, sampler − trainer KL by lag) and the plot."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from recipes.common import finish_figure, mean, rl_datum


def token_versions(seq) -> list[int]:
    """The in-flight version of each sampled token, from ``seq.versions`` (spans in order). Raises if the
    spans do not cover the tokens exactly once, in order: a correction must never guess a version."""
    out: list[int] = []
    for span in seq.versions:
        if span.first_token != len(out) or span.count <= 0:
            raise ValueError(f"version spans out of order: span at {span.first_token} after {len(out)} tokens")
        out += [int(span.weights.version)] * span.count
    if len(out) != len(seq.tokens):
        raise ValueError(f"version spans cover {len(out)} of {len(seq.tokens)} tokens")
    return out


def token_weights(lags: Sequence[int], max_lag: int, stale: str) -> list[float]:
    """How much each token's advantage counts: 1 within the bound; beyond it 0 (``drop``) or halved per
    version past the bound (``downweight``)."""
    if stale == "drop":
        return [1.0 if lag <= max_lag else 0.0 for lag in lags]
    if stale == "downweight":
        return [1.0 if lag <= max_lag else 0.5 ** (lag - max_lag) for lag in lags]
    raise ValueError(f"stale must be drop or downweight, not {stale!r}")


@dataclass
class Group:
    """One prompt's G samples, as a sampler worker finished them."""
    a: int
    b: int
    prompt: list[int]
    sequences: list  # SampledSequence, with .tokens, .logprobs and .versions
    rewards: list[float]
    cache_hit_tokens: int = 0
    finished_at: float = 0.0


@dataclass
class Batch:
    """The datums of one step and, per kept completion token, what the statistics need."""
    data: list = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    lags: list[list[int]] = field(default_factory=list)      # per datum, per completion token
    mixed: list[bool] = field(default_factory=list)          # per datum: decoded across an update
    histogram: Counter = field(default_factory=Counter)       # lag -> sampled tokens (all, kept or not)
    tokens_dropped: int = 0
    groups_skipped: int = 0
    sequences_mixed: int = 0
    rewards: list[float] = field(default_factory=list)


def build_batch(groups: Sequence[Group], current_version: int, max_lag: int, stale: str) -> Batch:
    """Importance-sampling datums from finished groups: advantage = reward − group mean on every
    completion token, times its staleness weight; the sampled logprobs are the behaviour logprobs (each
    token's own version produced it), so exp(trainer − sampled) is the exact ratio."""
    batch = Batch()
    for g in groups:
        batch.rewards += g.rewards
        baseline = mean(g.rewards)
        if all(r == baseline for r in g.rewards):
            batch.groups_skipped += 1  # no signal: every completion scored the same
            for s in g.sequences:
                batch.histogram.update(current_version - v for v in token_versions(s))
            continue
        for s, r in zip(g.sequences, g.rewards):
            versions = token_versions(s)
            lags = [current_version - v for v in versions]
            if any(lag < 0 for lag in lags):
                raise ValueError(f"a token of version {max(versions)} is newer than the trainer's {current_version}")
            batch.histogram.update(lags)
            mixed = len(set(versions)) > 1
            batch.sequences_mixed += mixed
            weights = token_weights(lags, max_lag, stale)
            batch.tokens_dropped += sum(w == 0.0 for w in weights)
            if not s.tokens or not any(weights):
                continue
            batch.data.append(rl_datum(g.prompt, s.tokens, s.logprobs, [(r - baseline) * w for w in weights]))
            batch.prompt_lengths.append(len(g.prompt))
            batch.lags.append(lags)
            batch.mixed.append(mixed)
    return batch


def step_stats(batch: Batch, output, max_lag: int) -> dict:
    """Sampler − trainer statistics over the kept completion tokens (within the bound), from the
    forward_backward output (its logprobs are the trainer's, before this step's update): the k1 KL
    estimate mean(sampled − trained), overall and by lag, the same for single-version sequences at lag 0
    (there sampler and trainer ran the same weights, so it is ~0 unless a version is misattributed), and
    the importance ratio."""
    diffs: dict[int, list[float]] = {}
    exact: list[float] = []
    ratios: list[float] = []
    for datum, out, n, lags, mixed in zip(batch.data, output.loss_fn_outputs, batch.prompt_lengths, batch.lags, batch.mixed):
        trained = out["logprobs"].to_numpy()[n - 1:]
        sampled = datum.loss_fn_inputs["logprobs"].to_numpy()[n - 1:]
        for lag, s, t in zip(lags, sampled, trained):
            if lag > max_lag:
                continue
            diffs.setdefault(lag, []).append(float(s - t))
            ratios.append(math.exp(float(t - s)))
            if lag == 0 and not mixed:
                exact.append(abs(float(s - t)))
    every = [d for ds in diffs.values() for d in ds]
    return {
        "kl_sample_train": mean(every), "kl_by_lag": {str(k): mean(v) for k, v in sorted(diffs.items())},
        "lag0_abs_diff_max": max(exact) if exact else None, "ratio_mean": mean(ratios),
        "ratio_max_dev": max((abs(r - 1.0) for r in ratios), default=None),
    }


def histogram_row(hist: Counter) -> dict[str, int]:
    return {str(k): int(v) for k, v in sorted(hist.items())}


def plot_async(path: Path, title: str, train_rows: list[dict], evals: list[tuple[float, float]],
               sync_rows: list[dict] | None = None) -> None:
    """Three panels: reward against wall-clock seconds (and held-out points; a synchronous run's too when
    given), the staleness histogram (sampled tokens per version lag, all steps), and sampler − trainer KL
    per step, overall and by lag."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_h, ax_k) = plt.subplots(1, 3, figsize=(16.5, 4))
    ax_r.plot([r["elapsed_s"] for r in train_rows], [r["train_reward"] for r in train_rows], marker="o", ms=3, label="train (sampled)")
    if evals:
        ax_r.plot([t for t, _ in evals], [a for _, a in evals], marker="s", ls="--", label="held-out (greedy)")
    if sync_rows:
        ax_r.plot([r["elapsed_s"] for r in sync_rows], [r["train_reward"] for r in sync_rows], marker="x", ms=3, alpha=0.7,
                  label="synchronous, train")
    ax_r.set_xlabel("wall-clock seconds")
    ax_r.set_ylabel("mean exact reward")
    total: Counter = Counter()
    for r in train_rows:
        total.update({int(k): v for k, v in r["staleness"].items()})
    lags = sorted(total)
    ax_h.bar([str(k) for k in lags], [total[k] for k in lags], color="tab:purple")
    ax_h.set_xlabel("version lag (trainer version − token's version)")
    ax_h.set_ylabel("sampled tokens")
    steps = [r["step"] for r in train_rows]
    ax_k.plot(steps, [r.get("kl_sample_train") for r in train_rows], marker="o", ms=3, label="all kept tokens")
    for lag in sorted({k for r in train_rows for k in r.get("kl_by_lag", {})}, key=int):
        ax_k.plot(steps, [r.get("kl_by_lag", {}).get(lag, np.nan) for r in train_rows], ms=3, marker=".", label=f"lag {lag}")
    ax_k.axhline(0.0, color="grey", lw=0.8)
    ax_k.set_xlabel("optimizer step")
    ax_k.set_ylabel("mean(sampled lp − trainer lp)")
    finish_figure(fig, (ax_r, ax_h, ax_k), title, path)
