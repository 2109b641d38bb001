"""A tenant's usage per UTC hour for GetBillingUsage (issue 33), read from what the scheduler keeps
anyway: ``run_metrics`` (forward_backward tokens: training), ``sampling_records`` (prompt tokens:
prefill; generated tokens: sampled) and ``checkpoints`` (saves and storage), over a ``Store``'s engine.

The token sums are grouped by the database (one row per hour, base model and session); checkpoints
are summed here (``common/billing.py``). What the records' retention pruned (``prune_records``) and
checkpoints deleted before the query are no longer counted.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import NamedTuple

from sqlalchemy import func, select

from temper.common.billing import HOUR_MS, Stored, hour_counts, storage_gigabyte_hours
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import database_errors

METRICS, SAMPLING = m.RunMetric.__table__, m.SamplingRecord.__table__


class Usage(NamedTuple):
    hour_ms: int
    base_model: str
    session_id: str
    kind: str
    token_count: int = 0
    count: int = 0
    gigabyte_hours: float = 0.0


def _ms(at: datetime) -> int:
    return int((at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp() * 1000)


@database_errors
class BillingReader:
    def __init__(self, store):
        self.engine = store.engine

    def billing_usage(self, tenant: str, from_ms: int, to_ms: int, now_ms: int) -> list[Usage]:
        """The tenant's usage in [from_ms, to_ms) (hour-aligned), by hour, kind, base model, session."""
        owned = (select(m.Session.id).join(m.Tenant, m.Tenant.id == m.Session.tenant_id)
                 .where(m.Tenant.name == tenant).scalar_subquery())
        trained_hour = (METRICS.c.answered_ms - from_ms) // HOUR_MS
        trained = (select(trained_hour, m.TrainingRun.base_model, m.TrainingRun.session_id, func.sum(METRICS.c.num_tokens))
                   .join(m.TrainingRun, m.TrainingRun.id == METRICS.c.training_run_id)
                   .where(m.TrainingRun.session_id.in_(owned), METRICS.c.kind == "forward_backward",
                          METRICS.c.status == "done", METRICS.c.answered_ms >= from_ms, METRICS.c.answered_ms < to_ms)
                   .group_by(trained_hour, m.TrainingRun.base_model, m.TrainingRun.session_id))
        sampled_hour = (SAMPLING.c.started_ms - from_ms) // HOUR_MS
        sampled = (select(sampled_hour, m.SamplingClient.base_model, SAMPLING.c.session_id, func.sum(SAMPLING.c.prompt_tokens),
                          func.sum(SAMPLING.c.tokens_sampled))
                   .select_from(SAMPLING.outerjoin(m.SamplingClient, m.SamplingClient.id == SAMPLING.c.sampler_id))
                   .where(SAMPLING.c.session_id.in_(owned), SAMPLING.c.started_ms >= from_ms, SAMPLING.c.started_ms < to_ms)
                   .group_by(sampled_hour, m.SamplingClient.base_model, SAMPLING.c.session_id))
        checkpoints = (select(m.Checkpoint.size_bytes, m.Checkpoint.created_at, m.Checkpoint.expires_at, m.TrainingRun.base_model)
                       .join(m.TrainingRun, m.TrainingRun.id == m.Checkpoint.training_run_id)
                       .where(m.TrainingRun.session_id.in_(owned), m.Checkpoint.ephemeral.is_(False)))
        out: list[Usage] = []
        with self.engine.connect() as conn:
            for hour, model, session, tokens in conn.execute(trained):
                out.append(Usage(from_ms + int(hour) * HOUR_MS, model or "", session, "training", int(tokens or 0)))
            for hour, model, session, prompt, generated in conn.execute(sampled):
                at = from_ms + int(hour) * HOUR_MS
                if prompt:
                    out.append(Usage(at, model or "", session, "sampling_prefill", int(prompt)))
                if generated:
                    out.append(Usage(at, model or "", session, "sampling_sample", int(generated)))
            rows = conn.execute(checkpoints).all()
        stored = [Stored(int(size or 0), model, _ms(created), min(_ms(expires), now_ms) if expires else now_ms)
                  for size, created, expires, model in rows]
        for (hour, model), n in hour_counts(((s.created_ms, s.base_model) for s in stored), from_ms, to_ms).items():
            out.append(Usage(hour, model, "", "checkpoint", count=n))
        for (hour, model), gbh in storage_gigabyte_hours(stored, from_ms, min(to_ms, now_ms)).items():
            out.append(Usage(hour, model, "", "storage", gigabyte_hours=gbh))
        return sorted(out, key=lambda u: (u.hour_ms, u.kind, u.base_model, u.session_id))
