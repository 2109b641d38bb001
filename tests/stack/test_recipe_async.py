"""recipes/rl_arithmetic_async.py end to end on the tiny model against a real local stack (issue 31, part
4): sampler threads on one in-flight client while the trainer steps and saves an in-flight version after
each step. A reward that varies within groups (the tiny model never answers a sum) makes every step
update the weights, so versions really differ. Checked on the groups the trainer received: the version
spans cover every token once, in order, with versions the run saved; trained tokens lag at most
--max-lag (older ones carry no advantage); tokens of the trainer's own version in single-version
sequences have the trainer's logprobs (a misattributed version would not); metrics finite; plot written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from recipes import rl_arithmetic_async
from recipes.async_rl_common import token_versions

PNG = b"\x89PNG\r\n\x1a\n"


def finite(value) -> bool:
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    return not isinstance(value, float) or math.isfinite(value)


def test_async_recipe_trains_on_versioned_tokens_within_the_lag_bound(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl_arithmetic_async, "reward", lambda text, a, b: float(len(text) % 2))
    received = []  # (groups, trainer version, batch) per step, as the trainer saw them
    real_build = rl_arithmetic_async.build_batch

    def recording_build(groups, version, max_lag, stale):
        batch = real_build(groups, version, max_lag, stale)
        received.append((groups, version, batch))
        return batch

    monkeypatch.setattr(rl_arithmetic_async, "build_batch", recording_build)
    out = tmp_path / "out"
    steps, max_lag = 4, 1
    assert rl_arithmetic_async.main([
        "--base-model", tiny_model_dir, "--steps", str(steps), "--threads", "1", "--group-size", "4", "--batch-prompts", "2",
        "--workers", "2", "--heldout", "2", "--eval-every", "2", "--max-tokens", "6", "--learning-rate", "1e-2",
        "--max-lag", str(max_lag), "--out-dir", str(out), "--data-dir", str(tmp_path / "data")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    # one in-flight save after each step that trained (a step whose groups all scored alike trains nothing)
    expected = [summary["first_version"]]
    for _, _, batch in received[:-1]:
        expected.append(expected[-1] + bool(batch.data))
    assert [v for _, v, _ in received] == expected
    assert summary["last_version"] == expected[-1] + bool(received[-1][2].data)
    saved = set(range(summary["first_version"], summary["last_version"] + 1))
    lags_trained, sequences = [], 0
    for groups, version, batch in received:
        for g in groups:
            for s in g.sequences:
                sequences += 1
                assert sum(span.count for span in s.versions) == len(s.tokens) and len(s.logprobs) == len(s.tokens)
                assert [span.first_token for span in s.versions] == list(np.cumsum([0] + [sp.count for sp in s.versions[:-1]]))
                assert set(token_versions(s)) <= saved and all(v <= version for v in token_versions(s))
        for datum, lags in zip(batch.data, batch.lags):
            adv = datum.loss_fn_inputs["advantages"].to_numpy()[-len(lags):]
            assert all(a == 0.0 for a, lag in zip(adv, lags) if lag > max_lag)  # dropped past the bound
            lags_trained += [lag for a, lag in zip(adv, lags) if a != 0.0]
    assert sequences == summary["sequences_checked"] == steps * 2 * 4
    assert lags_trained and max(lags_trained) <= max_lag
    assert sum(bool(b.data) for _, _, b in received) >= 2  # the weights changed at least twice

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert finite(r), r
        assert sum(r["staleness"].values()) == sum(len(s.tokens) for g in received[r["step"] - 1][0] for s in g.sequences)
        if r["datums"]:
            assert math.isfinite(r["loss"]) and math.isfinite(r["kl_sample_train"]) and r["save_s"] > 0
        if r.get("lag0_abs_diff_max") is not None:  # same weights on both sides: only float noise
            assert r["lag0_abs_diff_max"] < 1e-3, r
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, steps]
    assert 0.0 <= summary["heldout_reward_after"] <= 1.0 and 0.0 <= summary["cache_hit_rate"] <= 1.0
    assert (out / "async_rl.png").read_bytes()[:8] == PNG
