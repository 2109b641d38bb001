"""GET /api/v1/sessions/{id}/trace: the session's timeline as Chrome trace-event JSON (trace.py),
for Perfetto UI, from the rows the scheduler keeps. ``from_unix_ms`` / ``to_unix_ms`` pick a range
(default: the session's life); one holding more than the gateway's console_max_rows requests and
samples is refused (400), never built."""

from __future__ import annotations

import re

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from temper.services.gateway import fields
from temper.services.gateway.app import api_key, gateway
from temper.services.gateway.console.ranges import max_rows, session_range
from temper.services.gateway.console.records import session_records
from temper.services.gateway.console.trace import build_trace
from temper.v1 import records_pb2

router = APIRouter(prefix="/api/v1")
_FILE_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def caller(request: Request):
    key, scheduler = api_key(request), gateway(request).scheduler

    async def call(method: str, message):
        return await scheduler.call(method, message, key)
    return call


@router.get("/sessions/{session_id}/trace")
async def session_trace(session_id: str, request: Request):
    call = caller(request)
    fields.text(session_id, "session id")
    session = await call("GetSession", records_pb2.GetSessionRequest(session_id=session_id))
    span = session_range(request, session)
    records = await session_records(call, session, span.start_ms, span.end_ms, max_rows(request))
    trace = build_trace(session_id, records.run_rows, records.sampling, span.start_ms, span.end_ms)
    name = _FILE_SAFE.sub("_", session_id)[:80]
    return JSONResponse(trace, headers={"content-disposition": f'attachment; filename="temper-trace-{name}.json"'})
