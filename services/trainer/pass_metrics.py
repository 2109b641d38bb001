"""A pass group's summed metrics, as the trainer answers them (``<name>:sum`` adds up across chunks)."""

from __future__ import annotations

import numpy as np


def summed_metrics(group, loss_sum: float) -> dict[str, float]:
    """A group's (numerics.LossGroup) summed metrics. ``weights:sum`` (datums with a ``weights`` input, cross_entropy's) is
    the denominator of the cookbook's train_mean_nll (loss:sum / weights:sum); the scheduler keeps it
    with the request's other metrics, and the console's loss per weight divides by it."""
    metrics = {"loss:sum": loss_sum, "num_tokens:sum": float(sum(len(d.tokens) for d in group.data))}
    if group.data and all("weights" in d.inputs for d in group.data):
        metrics["weights:sum"] = float(sum(np.sum(d.inputs["weights"], dtype=np.float64) for d in group.data))
    return metrics
