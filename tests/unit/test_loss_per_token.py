"""The console's loss per weight (services/gateway/console/loss.py) and the trainer's weights:sum it
divides by (services/trainer/numerics.summed_metrics): the cookbook's train_mean_nll definition
(sum of weighted per-token NLL / sum of weights) computed here with torch on made-up logprobs; rows
without a loss, or without weights, show none. The same number on a real run through the SDK:
tests/stack/test_sdk_trace_export.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from temper.services.gateway.console.loss import loss_per_weight
from temper.services.gateway.console.views import view
from temper.services.trainer.losses import cross_entropy
from temper.services.trainer.numerics import LossGroup, summed_metrics
from temper.v1 import records_pb2


def datum(n_prompt: int, n_completion: int, weight: float = 1.0):
    n = n_prompt + n_completion
    weights = np.array([0.0] * n_prompt + [weight] * n_completion, np.float32)
    return SimpleNamespace(tokens=np.arange(n), inputs={"target_tokens": np.arange(1, n + 1), "weights": weights})


def test_loss_per_weight_is_train_mean_nll_of_the_same_logprobs():
    data = [datum(6, 3), datum(2, 5, weight=0.5), datum(9, 1)]
    generator = torch.Generator().manual_seed(0)
    logprobs = [-torch.rand(len(d.tokens), generator=generator, dtype=torch.float64) * 5 for d in data]
    # the trainer's loss:sum for cross_entropy: its elementwise loss summed over tokens and datums
    loss_sum = sum(float(cross_entropy(lp, {"weights": torch.from_numpy(d.inputs["weights"]).double()}, {})[0].sum())
                   for lp, d in zip(logprobs, data))
    metrics = summed_metrics(LossGroup("a", data, "cross_entropy"), loss_sum)
    weights = torch.cat([torch.from_numpy(d.inputs["weights"]).double() for d in data])
    assert metrics["weights:sum"] == float(weights.sum()) == 3 + 2.5 + 1
    assert metrics["num_tokens:sum"] == sum(len(d.tokens) for d in data)

    train_mean_nll = float(-(torch.cat(logprobs) * weights).sum() / weights.sum())
    row = records_pb2.RunMetric(kind="forward_backward", status="done", loss=loss_sum, metrics=metrics,
                                num_tokens=int(metrics["num_tokens:sum"]))
    assert loss_per_weight(row) == pytest.approx(train_mean_nll, rel=1e-12)
    assert loss_sum / row.num_tokens < 0.5 * train_mean_nll  # what dividing by all tokens read


def test_rows_without_a_loss_or_without_weights_show_none():
    optim = records_pb2.RunMetric(kind="optim_step", status="done", grad_norm=1.5, metrics={"grad_norm:mean": 1.5})
    assert loss_per_weight(optim) is None
    shown = view(optim)
    assert shown["loss"] is None and shown["grad_norm"] == 1.5 and shown["learning_rate"] is None
    rl = records_pb2.RunMetric(kind="forward_backward", status="done", loss=-2.0, metrics={"loss:sum": -2.0})
    assert loss_per_weight(rl) is None  # an RL loss: no weights, nothing to divide by
    zero = records_pb2.RunMetric(kind="forward_backward", status="done", loss=0.0, metrics={"weights:sum": 0.0})
    assert loss_per_weight(zero) is None and view(zero)["loss"] == 0.0  # a loss of 0 is still a loss
    assert "weights:sum" not in summed_metrics(LossGroup("a", [SimpleNamespace(
        tokens=np.arange(3), inputs={"target_tokens": np.arange(3), "advantages": np.ones(3, np.float32)})], "ppo"), 1.0)
