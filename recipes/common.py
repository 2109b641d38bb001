"""Shared helpers for the recipes and examples/trajectory_judge: stack start-up, chat-template
token ids, datums, greedy evaluation, metrics JSONL, plots and the final JSON line. Everything
model-facing goes through ``temper.client``; nothing here imports torch."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from temper.client import Datum, ModelInput, SamplingParams, ServiceClient
from temper.services.models.prepare import SMOLLM2_NAME


def add_common_args(p: argparse.ArgumentParser, name: str, steps: int, learning_rate: float, rank: int = 16) -> None:
    p.add_argument("--base-model", default=SMOLLM2_NAME, help="base model name or local transformers folder")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--learning-rate", type=float, default=learning_rate)
    p.add_argument("--rank", type=int, default=rank, help="LoRA rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("runs") / name, help="metrics.jsonl, PNG and summary go here")
    p.add_argument("--data-dir", type=Path, default=Path("data") / name, help="the local stack's SQLite, logs, checkpoints")
    p.add_argument("--threads", type=int, default=2, help="torch threads per service")
    p.add_argument("--address", default=None,
                   help="use a running Temper scheduler at host:port instead of starting a local stack "
                        "(then checkpoints from earlier runs on it, e.g. a --teacher-path, are reachable)")


@contextlib.contextmanager
def local_client(args: argparse.Namespace) -> Iterator[ServiceClient]:
    """Start scheduler, trainer and sampler on loopback (as the demo does) and yield a client;
    with ``--address``, connect to that scheduler instead (its API key from TEMPER_API_KEY)."""
    from temper.localstack import LocalStack

    if args.address:
        with ServiceClient(args.address) as client:
            yield client
        return

    if threading.current_thread() is threading.main_thread():
        # A plain SIGTERM would skip the cleanup below and orphan the three services.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.base_model == SMOLLM2_NAME:
        from temper.services.models.prepare import prepare_smollm2

        prepare_smollm2()  # cached after the first time
    with LocalStack(args.base_model, args.data_dir / time.strftime("%Y%m%d-%H%M%S"), num_threads=args.threads) as stack:
        print("starting scheduler, trainer and sampler ...", file=sys.stderr)
        stack.start()
        with stack.client() as client:  # the stack made a local API key for it
            yield client


# ---- token ids ------------------------------------------------------------------------------------


def _as_ids(out) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def chat_prompt(tokenizer, messages: list[dict], prefill: str = "") -> list[int]:
    """Chat-template tokens ending with the assistant header (plus optional prefilled text)."""
    ids = _as_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    if prefill:
        ids += list(tokenizer.encode(prefill, add_special_tokens=False))
    return ids


def end_token_id(tokenizer) -> int:
    """The token that ends an assistant turn: ChatML's <|im_end|> when the vocabulary has it, else eos."""
    eid = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return eid if isinstance(eid, int) and eid >= 0 and eid != tokenizer.unk_token_id else tokenizer.eos_token_id


# ---- greedy evaluation ----------------------------------------------------------------------------


def greedy_futures(sampler, prompts: Sequence[Sequence[int]], max_tokens: int = 1) -> list:
    """Greedy (temperature 0) samples of ``prompts``, all submitted before any wait so the sampler
    batches them (and, submitted early, they share batches with other work)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [sampler.sample(ModelInput.from_ints(list(p)), 1, params) for p in prompts]


def decode_replies(futures, tokenizer, desc: str | None = None, skip_special_tokens: bool = False) -> list[str]:
    """Decoded first sequence of each sample future, waited for in order (progress bar with ``desc``)."""
    if desc:
        futures = tqdm(futures, desc=desc, unit="case", leave=False)
    return [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=skip_special_tokens) for f in futures]


# ---- datums ---------------------------------------------------------------------------------------


def rl_datum(prompt: Sequence[int], completion: Sequence[int], sampler_logprobs: Sequence[float],
             advantages: float | Sequence[float]) -> Datum:
    """Importance-sampling / PPO datum for one sampled completion.

    model_input = prompt + completion[:-1]; target_tokens = the same sequence shifted by one. The
    loss inputs are aligned with the targets: 0 on prompt positions, the sampler's logprob and the
    advantage (a scalar broadcast over the completion, or one value per completion token) on
    completion positions.
    """
    tokens = list(prompt) + list(completion)
    n = len(tokens) - 1
    logprobs = np.zeros(n, np.float32)
    adv = np.zeros(n, np.float32)
    start = len(prompt) - 1  # target index of the first completion token
    logprobs[start:] = np.asarray(sampler_logprobs, np.float32)
    adv[start:] = advantages if np.isscalar(advantages) else np.asarray(advantages, np.float32)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "logprobs": logprobs, "advantages": adv},
    )


def shifted_datum(tokens: Sequence[int], weights: Sequence[float]) -> Datum:
    """Next-token datum from per-token weights: input tokens[:-1] predicts tokens[1:], each target
    weighted like its token (``weights`` is aligned with ``tokens``; weights[0] is unused)."""
    tokens = list(tokens)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.asarray(weights[1:], np.float32)},
    )


def weighted_datum(prompt: Sequence[int], completion: Sequence[int]) -> Datum:
    """Next-token datum with weight 1 on completion targets and 0 on prompt targets."""
    return shifted_datum(list(prompt) + list(completion), [0.0] * len(prompt) + [1.0] * len(completion))


def completion_ratio_stats(data: Sequence[Datum], output, prompt_lengths: Sequence[int]) -> dict[str, float]:
    """Importance ratio exp(trainer lp − sampler lp) over completion targets only, from a
    forward_backward output of ``rl_datum``s: its mean, its largest distance from 1, the mean |lp
    difference| (≈0 on the first use of a sample: sampler and trainer agree; exactly 0 in deterministic
    mode) and ``kl_sample_train``, the mean of sampler lp − trainer lp over the sampled tokens (the k1
    estimate of KL(sampler ‖ trainer), as the cookbook reports it). Prompt targets are excluded: their
    sampler logprobs are 0 placeholders (the server's ``ratio:mean`` leaves them out too)."""
    ratios, diffs = [], []
    for datum, out, n in zip(data, output.loss_fn_outputs, prompt_lengths):
        diff = out["logprobs"].to_numpy()[n - 1:] - datum.loss_fn_inputs["logprobs"].to_numpy()[n - 1:]
        ratios += np.exp(diff).tolist()
        diffs += diff.tolist()
    return {"ratio_mean": mean(ratios), "ratio_max_dev": max(abs(r - 1.0) for r in ratios),
            "logprob_abs_diff": mean([abs(d) for d in diffs]), "kl_sample_train": 0.0 - mean(diffs)}


# ---- metrics, plots, summary ----------------------------------------------------------------------


class MetricsLog:
    """Append-only JSONL: one object per line, each stamped with elapsed seconds."""

    def __init__(self, path: Path, started: float):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.started = path, started
        self.rows: list[dict] = []
        self._fh = open(path, "w")

    def write(self, **row) -> dict:
        row = {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in row.items()}  # 6 significant digits: 1e-9 stays 1e-9, not 0
        row["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.rows.append(row)
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        return row

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_panels(path: Path, title: str, panels: list[dict]) -> None:
    """One subplot per panel: {"ylabel", "series": [(label, xs, ys), ...]}; markers when few points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, xs, ys in panel["series"]:
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None and not (isinstance(y, float) and math.isnan(y))]
            if not pts:
                continue
            px, py = zip(*pts)
            ax.plot(px, py, marker="o" if len(pts) <= 30 else None, ms=3, lw=1.5, label=label)
        ax.set_xlabel(panel.get("xlabel", "optimizer step"))
        ax.set_ylabel(panel["ylabel"])
    finish_figure(fig, axes[0], title, path)


def finish_figure(fig, axes, title: str, path: Path) -> None:
    """Grid and legend on each axis, the title, then the PNG at ``path`` (its folder made)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if any(ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(summary: dict, out_dir: Path) -> int:
    """Write summary.json and print the final JSON line (the last line of stdout)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


def mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")
