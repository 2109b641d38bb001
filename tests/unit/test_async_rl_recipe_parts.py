"""recipes/async_rl_common.py without a model: per-token versions from spans (every token covered once,
in order, or an error), the staleness bound, the importance-sampling datums built from stale groups, and
the per-step statistics against a direct numpy computation."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace as NS

import numpy as np
import pytest

from recipes.async_rl_common import Group, build_batch, step_stats, token_versions, token_weights
from temper.client import TensorData


def span(version: int, first: int, count: int):
    return NS(weights=NS(path=f"tinker://r/sampler_weights/inflight-{version}", version=version), first_token=first, count=count)


def seq(tokens, logprobs, spans):
    return NS(tokens=list(tokens), logprobs=list(logprobs), versions=spans)


def test_token_versions_follow_the_spans_and_refuse_gaps_overlaps_and_short_cover():
    assert token_versions(seq([5, 6, 7], [0, 0, 0], [span(3, 0, 2), span(4, 2, 1)])) == [3, 3, 4]
    assert token_versions(seq([], [], [])) == []
    for bad in ([span(3, 0, 2)], [span(3, 0, 1), span(4, 2, 1)], [span(3, 0, 2), span(4, 1, 2)], [span(3, 0, 4)]):
        with pytest.raises(ValueError):
            token_versions(seq([5, 6, 7], [0, 0, 0], bad))


def test_token_weights_drop_or_halve_past_the_bound():
    assert token_weights([0, 1, 2, 3], 1, "drop") == [1.0, 1.0, 0.0, 0.0]
    assert token_weights([0, 1, 2, 3], 1, "downweight") == [1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ValueError):
        token_weights([0], 1, "keep")


def test_build_batch_masks_stale_tokens_and_counts_every_lag():
    prompt = [1, 2, 3]
    fresh = seq([10, 11], [-0.5, -0.25], [span(5, 0, 2)])
    crossed = seq([12, 13, 14], [-1.0, -2.0, -3.0], [span(3, 0, 1), span(4, 1, 1), span(5, 2, 1)])  # lags 2, 1, 0
    constant = Group(7, 8, prompt, [fresh, fresh], [1.0, 1.0])
    mixed = Group(2, 3, prompt, [fresh, crossed], [1.0, 0.0])
    batch = build_batch([constant, mixed], current_version=5, max_lag=1, stale="drop")
    assert batch.groups_skipped == 1 and batch.rewards == [1.0, 1.0, 1.0, 0.0]
    assert batch.histogram == Counter({0: 2 + 2 + 2 + 1, 1: 1, 2: 1})
    assert batch.tokens_dropped == 1 and batch.sequences_mixed == 1 and batch.mixed == [False, True]
    adv = batch.data[1].loss_fn_inputs["advantages"].to_numpy()
    np.testing.assert_allclose(adv, [0, 0, 0.0, -0.5, -0.5])  # the lag-2 token's advantage is dropped
    np.testing.assert_allclose(batch.data[1].loss_fn_inputs["logprobs"].to_numpy(), [0, 0, -1, -2, -3])
    assert batch.lags == [[0, 0], [2, 1, 0]]
    down = build_batch([mixed], current_version=5, max_lag=1, stale="downweight")
    np.testing.assert_allclose(down.data[1].loss_fn_inputs["advantages"].to_numpy(), [0, 0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="newer"):
        build_batch([mixed], current_version=4, max_lag=1, stale="drop")


def test_step_stats_match_a_direct_computation():
    prompt = [1, 2, 3]
    a = seq([10, 11], [-0.5, -0.25], [span(5, 0, 2)])
    b = seq([12, 13, 14], [-1.0, -2.0, -3.0], [span(3, 0, 1), span(4, 1, 2)])  # lags 2, 1, 1
    batch = build_batch([Group(2, 3, prompt, [a, b], [1.0, 0.0])], current_version=5, max_lag=1, stale="drop")
    trained = [np.array([0, 0, -0.5001, -0.2498], np.float32), np.array([0, 0, -1.5, -2.2, -2.9], np.float32)]
    out = NS(loss_fn_outputs=[{"logprobs": TensorData.from_numpy(t)} for t in trained])
    stats = step_stats(batch, out, max_lag=1)
    lag0 = [-0.5 - -0.5001, -0.25 - -0.2498]
    lag1 = [-2.0 - -2.2, -3.0 - -2.9]  # the lag-2 token (-1.0 vs -1.5) is past the bound: left out
    assert stats["kl_by_lag"]["0"] == pytest.approx(np.mean(lag0), abs=1e-6)
    assert stats["kl_by_lag"]["1"] == pytest.approx(np.mean(lag1), abs=1e-6)
    assert stats["kl_sample_train"] == pytest.approx(np.mean(lag0 + lag1), abs=1e-6)
    assert stats["lag0_abs_diff_max"] == pytest.approx(max(abs(d) for d in lag0), abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx(np.mean(np.exp([-d for d in lag0 + lag1])), abs=1e-6)
