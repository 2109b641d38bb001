"""The base models the database names: this deployment served them before (``workers/presence.py``
answers a missing worker of one as transient, not NOT_FOUND)."""

from __future__ import annotations

from sqlalchemy import select, union

from temper.scheduler.db import models as m


def named_base_models(store) -> set[str]:
    """Every base model of a training run or a sampling client (one query, at start)."""
    query = union(select(m.TrainingRun.base_model), select(m.SamplingClient.base_model))
    with store.sessions() as db:
        return set(db.scalars(query))
