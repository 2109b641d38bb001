"""The session trace routes, Chrome trace-event JSON (trace.py, which Perfetto UI opens) built from
the rows the scheduler keeps:

- GET /api/v1/sessions/{id}/trace: the console's download. ``from_unix_ms`` / ``to_unix_ms`` pick
  a range (default: the session's life).
- GET /api/v1/sessions/{id}/trace_export: the Tinker SDK's ``RestClient.export_session_trace``,
  polled until ``{"status": "ready", "url": ...}`` (trace_exports.py: jobs, polling, signed URLs);
  the session's whole life.
- GET /api/v1/trace_exports/{export_id}?expires=&signature=: the file behind such a URL, no key
  needed (the signature is the credential), 403 when tampered or expired, 404 when not kept.

A range holding more than the gateway's console_max_rows requests and samples is refused (400 for
/trace, a ``failed`` export with that message), never built. Another tenant's session is 404 (the
scheduler's GetSession with the caller's key), before anything is built."""

from __future__ import annotations

import json
import re
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from temper.services.gateway import fields
from temper.services.gateway.app import api_key, gateway
from temper.services.gateway.console.ranges import Range, max_rows, session_range
from temper.services.gateway.console.records import session_records
from temper.services.gateway.console.trace import build_trace
from temper.services.gateway.console.trace_exports import TraceExports
from temper.v1 import records_pb2

router = APIRouter(prefix="/api/v1")
_FILE_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def caller(request: Request):
    key, scheduler = api_key(request), gateway(request).scheduler

    async def call(method: str, message):
        return await scheduler.call(method, message, key)
    return call


def _filename(session_id: str) -> str:
    return f"temper-trace-{_FILE_SAFE.sub('_', session_id)[:80]}.json"


async def _trace(call, session, span: Range, budget: int) -> dict:
    records = await session_records(call, session, span.start_ms, span.end_ms, budget)
    return build_trace(session.session_id, records.run_rows, records.sampling, span.start_ms, span.end_ms)


def _exports(request: Request) -> TraceExports:
    """The process's export jobs, made on first use (they live as long as the app)."""
    state = request.app.state
    if getattr(state, "trace_exports", None) is None:
        state.trace_exports = TraceExports()
    return state.trace_exports


def _whole_life(session) -> Range:
    """Creation to close, or to now for an open session (what the SDK's export covers)."""
    end = session.closed_unix_ms + 1 if session.closed else int(time.time() * 1000) + 1
    return Range(session.created_unix_ms, max(end, session.created_unix_ms + 1))


async def _session(request: Request, session_id: str):
    call = caller(request)
    fields.text(session_id, "session id")
    return call, await call("GetSession", records_pb2.GetSessionRequest(session_id=session_id))


@router.get("/sessions/{session_id}/trace")
async def session_trace(session_id: str, request: Request):
    call, session = await _session(request, session_id)
    trace = await _trace(call, session, session_range(request, session), max_rows(request))
    return JSONResponse(trace, headers={"content-disposition": f'attachment; filename="{_filename(session_id)}"'})


@router.get("/sessions/{session_id}/trace_export")
async def session_trace_export(session_id: str, request: Request):
    call, session = await _session(request, session_id)
    span, budget = _whole_life(session), max_rows(request)

    async def build() -> bytes:
        return json.dumps(await _trace(call, session, span, budget), separators=(",", ":")).encode()

    answer = await _exports(request).poll(session.session_id, session.closed, build)
    if answer["url"] is not None:  # absolute, as the SDK hands it to urllib
        answer["url"] = str(request.base_url).rstrip("/") + answer["url"]
    return answer


@router.get("/trace_exports/{export_id}")
async def trace_export_file(export_id: str, request: Request):
    params = request.query_params
    job, body = _exports(request).download(export_id, params.get("expires", ""), params.get("signature", ""))
    return Response(body, media_type="application/json",
                    headers={"content-disposition": f'attachment; filename="{_filename(job.session_id)}"',
                             "cache-control": "private, no-store"})
