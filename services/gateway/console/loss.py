"""The run page's loss per weight: a forward_backward row's ``loss`` (its answer's loss:sum) divided
by its ``weights:sum`` metric, the sum of the request's loss weights. For cross_entropy this is the
cookbook's ``train_mean_nll`` (sum of weighted per-token NLL / sum of weights) of that request: the
prompt tokens, weighted 0, count in neither. Dividing by all tokens instead (the old "loss per token")
read a fraction of it, smaller the longer the prompts.

None where there is nothing to divide: a row without a loss (optim_step, save, failed), a loss whose
datums carry no weights (the RL losses: their answers have no weights:sum), or weights summing to 0."""

from __future__ import annotations

import math

from temper.v1 import records_pb2

WEIGHTS_SUM = "weights:sum"  # the trainer's metric (services/trainer/pass_metrics.py summed_metrics)


def loss_per_weight(row: records_pb2.RunMetric) -> float | None:
    if not row.HasField("loss"):
        return None
    weights = row.metrics.get(WEIGHTS_SUM)
    if weights is None or not weights > 0:
        return None
    value = row.loss / weights
    return value if math.isfinite(value) else None
