"""The console's session routes: the tenant's sessions, one session (its runs and sampling
clients), its Session Metrics over a range, and a run's kept per-request metrics (the run page's
curves). Ranges holding more than console_max_rows rows are refused, never gathered."""

from __future__ import annotations

from fastapi import APIRouter, Request

from temper.services.gateway import fields
from temper.services.gateway.app import api_key
from temper.services.gateway.console.api_tenant import MAX_PAGE, call, query_int
from temper.services.gateway.console.loss import loss_per_weight
from temper.services.gateway.console.ranges import max_rows, session_range
from temper.services.gateway.console.records import PAGE, TooLarge, session_records
from temper.services.gateway.console.series import MAX_BUCKETS, session_series
from temper.services.gateway.console.trace_route import caller
from temper.services.gateway.console.views import view
from temper.v1 import records_pb2, service_pb2

router = APIRouter(prefix="/console/api")


@router.get("/sessions")
async def sessions(request: Request):
    api_key(request)
    limit, offset = query_int(request, "limit", 50, 1, MAX_PAGE), query_int(request, "offset", 0)
    listed = await call(request, "ListSessions", records_pb2.ListSessionsRequest(limit=limit, offset=offset))
    return {"sessions": [view(s) for s in listed.sessions], "total_count": listed.total_count,
            "limit": limit, "offset": offset}


@router.get("/sessions/{session_id}")
async def session(session_id: str, request: Request):
    api_key(request)
    fields.text(session_id, "session id")
    info = await call(request, "GetSession", records_pb2.GetSessionRequest(session_id=session_id))
    runs = [view(await call(request, "GetInfo", service_pb2.GetInfoRequest(training_run_id=run_id)))
            for run_id in list(info.training_run_ids)[:MAX_PAGE]]
    return {"session": view(info), "runs": runs}


@router.get("/sessions/{session_id}/metrics")
async def session_metrics(session_id: str, request: Request):
    rpc = caller(request)
    fields.text(session_id, "session id")
    buckets = query_int(request, "buckets", 120, 1, MAX_BUCKETS)
    info = await rpc("GetSession", records_pb2.GetSessionRequest(session_id=session_id))
    span = session_range(request, info)
    records = await session_records(rpc, info, span.start_ms, span.end_ms, max_rows(request))
    series = session_series(records.run_rows, records.sampling, span.start_ms, span.end_ms, buckets)
    return {"from_unix_ms": span.start_ms, "to_unix_ms": span.end_ms, **series}


@router.get("/runs/{run_id}/metrics")
async def run_metrics(run_id: str, request: Request):
    """Every kept row of the run with step in [from_step, to_step], in seq order, read page by page;
    each with ``loss_per_weight`` (loss.py: the cookbook's train_mean_nll of that request, or null)."""
    api_key(request)
    fields.text(run_id, "run id")
    from_step = query_int(request, "from_step", 0, 0, fields.INT64[1])
    to_step = request.query_params.get("to_step")
    budget = max_rows(request)
    rows, token = [], ""
    while True:
        message = records_pb2.ListRunMetricsRequest(training_run_id=run_id, from_step=from_step, page_size=PAGE,
                                                    page_token=token)
        if to_step not in (None, ""):
            message.to_step = query_int(request, "to_step", 0, 0, fields.INT64[1])
        page = await call(request, "ListRunMetrics", message)
        rows.extend({**view(m), "loss_per_weight": loss_per_weight(m)} for m in page.metrics)
        if len(rows) > budget:
            raise TooLarge("rows", budget)
        token = page.next_page_token
        if not token:
            break
    return {"training_run_id": run_id, "metrics": rows}
