"""The records kept after an answer, read back (issue 22; tables in ``db/records.py``):
ListRunMetrics, ListSessions, GetSession, GetSessionSamplingMetrics.

Reads only: nothing here changes state, and nothing loads a run into the scheduler. The caller sees
its own tenant's runs and sessions; another tenant's id answers the same NOT_FOUND as a missing one.
Every range and page is checked and bounded before the database is asked (INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import time

from temper.common.errors import InvalidArgument, NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.session_search import unix_us
from temper.scheduler.db.views import unix_ms
from temper.scheduler.tenancy.auth import caller
from temper.v1 import records_pb2

DEFAULT_PAGE, MAX_PAGE = 100, 1000
DEFAULT_SESSIONS, MAX_SESSIONS = 20, 1000
MAX_BUCKETS = 10_000


def page_size(asked: int) -> int:
    if not 0 <= asked <= MAX_PAGE:
        raise InvalidArgument(f"page_size must be in [0, {MAX_PAGE}] (0: {DEFAULT_PAGE}), got {asked}")
    return asked or DEFAULT_PAGE


def _after_seq(token: str) -> int:
    if not token:
        return 0
    if not token.isdigit() or len(token) > 19:
        raise InvalidArgument("page_token is not one this call answered")
    return int(token)


def _after_record(token: str) -> tuple[int, int] | None:
    if not token:
        return None
    started, _, row_id = token.partition(".")
    if not (started.isdigit() and row_id.isdigit() and len(started) <= 19 and len(row_id) <= 19):
        raise InvalidArgument("page_token is not one this call answered")
    return int(started), int(row_id)


def metric_message(row: m.RunMetric) -> records_pb2.RunMetric:
    out = records_pb2.RunMetric(
        seq_id=row.seq_id, step=row.step, kind=row.kind, status=row.status, error=row.error or "", num_tokens=row.num_tokens,
        metrics={str(k): float(v) for k, v in (row.metrics or {}).items()}, queued_seconds=row.queued_seconds,
        trainer_seconds=row.trainer_seconds, cobatched_with=row.cobatched_with, trainer=row.trainer, cycle=row.cycle,
        created_unix_ms=row.created_ms, started_unix_ms=row.started_ms, answered_unix_ms=row.answered_ms)
    for name in ("loss", "grad_norm", "learning_rate"):
        if getattr(row, name) is not None:
            setattr(out, name, getattr(row, name))
    return out


def session_message(row: m.Session) -> records_pb2.SessionInfo:
    return records_pb2.SessionInfo(
        session_id=row.id, tags=[str(t) for t in row.tags or []], user_metadata={str(k): str(v) for k, v in (row.user_metadata or {}).items()},
        created_unix_ms=unix_ms(row.created_at), last_heartbeat_unix_ms=unix_ms(row.last_heartbeat_at),
        closed=row.closed_at is not None, close_status=row.close_status or "", closed_unix_ms=unix_ms(row.closed_at),
        display_name=row.display_name or "", project_id=row.project_id or "", created_unix_us=unix_us(row.created_at))


class RecordVerbs:
    """Mixed into TemperServicer (store comes from it)."""

    async def ListRunMetrics(self, request, context):
        if request.from_step < 0 or (request.HasField("to_step") and request.to_step < request.from_step):
            raise InvalidArgument(f"the step range must have 0 <= from_step <= to_step, got [{request.from_step}, "
                                  f"{request.to_step if request.HasField('to_step') else ''}]")
        limit, after = page_size(request.page_size), _after_seq(request.page_token)
        if await asyncio.to_thread(self.store.run_owner, request.training_run_id) != caller():
            raise NotFound(f"training run {request.training_run_id!r} not found")
        to_step = request.to_step if request.HasField("to_step") else None
        rows = await asyncio.to_thread(self.store.run_metrics, request.training_run_id, request.from_step, to_step, after, limit + 1)
        response = records_pb2.ListRunMetricsResponse(metrics=[metric_message(r) for r in rows[:limit]])
        if len(rows) > limit:
            response.next_page_token = str(rows[limit - 1].seq_id)
        return response

    async def ListSessions(self, request, context):
        limit = request.limit or DEFAULT_SESSIONS
        if not 0 < limit <= MAX_SESSIONS or request.offset < 0:
            raise InvalidArgument(f"limit must be in [0, {MAX_SESSIONS}] (0: {DEFAULT_SESSIONS}) and offset >= 0")
        if request.project_id:  # issue 33: NotFound for a project not the caller's
            await asyncio.to_thread(self.store.check_projects, [request.project_id], caller())
        rows, total = await asyncio.to_thread(self.store.tenant_sessions, caller(), limit, request.offset, request.project_id)
        return records_pb2.ListSessionsResponse(sessions=[session_message(r) for r in rows], total_count=total)

    async def GetSession(self, request, context):
        detail = await asyncio.to_thread(self.store.session_detail, request.session_id, caller())
        info = session_message(detail.row)
        info.training_run_ids.extend(detail.run_ids)
        info.sampler_ids.extend(detail.sampler_ids)
        info.sample_requests, info.prompt_tokens, info.tokens_sampled = detail.requests, detail.prompt_tokens, detail.tokens_sampled
        return info

    async def GetSessionSamplingMetrics(self, request, context):
        to_ms = request.to_unix_ms if request.HasField("to_unix_ms") else int(time.time() * 1000) + 1
        if request.from_unix_ms < 0 or to_ms <= request.from_unix_ms:
            raise InvalidArgument(f"the time range must have 0 <= from_unix_ms < to_unix_ms, got [{request.from_unix_ms}, {to_ms})")
        if request.bucket_seconds < 0:
            raise InvalidArgument(f"bucket_seconds must be >= 0 (0: the records), got {request.bucket_seconds}")
        bucket_ms = request.bucket_seconds * 1000
        if bucket_ms and -(-(to_ms - request.from_unix_ms) // bucket_ms) > MAX_BUCKETS:
            raise InvalidArgument(f"the range holds more than {MAX_BUCKETS} buckets of {request.bucket_seconds} s: "
                                  f"use longer buckets or a shorter range")
        limit = page_size(request.page_size)
        after = _after_record(request.page_token)
        if bucket_ms and after is not None:
            raise InvalidArgument("buckets come in one page: page_token is for records (bucket_seconds 0)")
        await asyncio.to_thread(self.store.session_detail, request.session_id, caller())  # NotFound: not the caller's
        response = records_pb2.GetSessionSamplingMetricsResponse()
        if bucket_ms:
            for b in await asyncio.to_thread(self.store.sampling_buckets, request.session_id, request.from_unix_ms, to_ms, bucket_ms):
                start = request.from_unix_ms + b.index * bucket_ms
                response.buckets.add(start_unix_ms=start, end_unix_ms=min(start + bucket_ms, to_ms), requests=b.requests,
                                     prompt_tokens=b.prompt_tokens, tokens_sampled=b.tokens_sampled, busy_seconds=b.busy_ms / 1000)
            return response
        rows = await asyncio.to_thread(self.store.sampling_records, request.session_id, request.from_unix_ms, to_ms, after, limit + 1)
        for r in rows[:limit]:
            response.records.add(sampler_id=r.sampler_id, kind=r.kind, num_samples=r.num_samples, prompt_tokens=r.prompt_tokens,
                                 tokens_sampled=r.tokens_sampled, started_unix_ms=r.started_ms, answered_unix_ms=r.answered_ms)
        if len(rows) > limit:
            response.next_page_token = f"{rows[limit - 1].started_ms}.{rows[limit - 1].id}"
        return response
