"""The SDK routes over what the scheduler keeps: sessions (``RestClient.list_sessions``,
``get_session``), checkpoint storage (``AdminClient.get_current_checkpoint_storage_usage``), and
``GET /api/v1/whoami`` (the caller's tenant and key prefix).

Shapes are the SDK's: ``ListSessionsResponse {sessions: [id]}``, ``GetSessionResponse
{training_run_ids, sampler_ids, user_metadata, display_name}``,
``CurrentCheckpointStorageUsageResponse {effective_rate_usd_per_gigabyte_month, data: [item]}`` and
``WhoamiResponse {user_urn, org_urn, email}``. A tenant sees only its own (another tenant's session
is 404, as a missing one). ``project_id`` (list_sessions, storage usage) filters by one of the
caller's projects (``routes_projects.py``); another tenant's project is 404, as a missing one.
``access_scope`` ``accessible`` answers as ``owned``: another tenant's sessions are never readable.

The SDK's own ``whoami()`` reads the claims of the JWT it got from ``/api/v1/auth/token``
(routes_session.py) client-side and never calls a server; ``/api/v1/whoami`` answers the same shape for a
plain API key, for ``curl`` and ``temper.client``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from temper.services.gateway import fields
from temper.services.gateway.app import api_key, gateway
from temper.services.gateway.errors import invalid
from temper.v1 import records_pb2, service_pb2

router = APIRouter(prefix="/api/v1")
SCOPES = ("owned", "accessible")
MAX_SESSIONS = 1000  # ListSessions' largest page


def _scope(request: Request) -> None:
    scope = request.query_params.get("access_scope", "owned")
    if scope not in SCOPES:
        raise invalid(f"access_scope must be owned or accessible, got {scope[:40]!r}")


def _project(request: Request) -> str:
    """The ``project_id`` query parameter ("" when absent); the scheduler answers 404 for one not the caller's."""
    return fields.text(request.query_params.get("project_id", ""), "project_id")


def _int(request: Request, name: str, default: int, hi: int) -> int:
    raw = request.query_params.get(name, str(default))
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 10 and int(raw) <= hi):
        raise invalid(f"{name} must be an integer in [0, {hi}]")
    return int(raw)


@router.get("/sessions")
async def list_sessions(request: Request):
    key = api_key(request)
    _scope(request)
    limit, offset = _int(request, "limit", 20, MAX_SESSIONS), _int(request, "offset", 0, 2**31 - 1)
    if limit == 0:
        return {"sessions": []}
    project_id = _project(request)
    listed = await gateway(request).scheduler.call(
        "ListSessions", records_pb2.ListSessionsRequest(limit=limit, offset=offset, project_id=project_id), key)
    return {"sessions": [s.session_id for s in listed.sessions]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request):
    key = api_key(request)
    _scope(request)
    fields.text(session_id, "session_id")
    info = await gateway(request).scheduler.call("GetSession", records_pb2.GetSessionRequest(session_id=session_id), key)
    return {"training_run_ids": list(info.training_run_ids), "sampler_ids": list(info.sampler_ids),
            "user_metadata": dict(info.user_metadata) or None, "display_name": info.display_name or None}


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(request: Request):
    key = api_key(request)
    scheduler = gateway(request).scheduler
    project_id = _project(request)
    if project_id:  # the checkpoints of the project's sessions (images belong to no project)
        listed = await scheduler.call("ListCheckpoints", service_pb2.ListCheckpointsRequest(project_ids=[project_id]), key)
        size = sum(c.size_bytes for c in listed.checkpoints)
        return {"effective_rate_usd_per_gigabyte_month": None, "data": [{
            "project_id": project_id, "org_user_urn": None, "user_email": None, "user_name": None,
            "checkpoint_count": len(listed.checkpoints), "size_bytes": size, "size_gigabytes": size / 1e9,
            "estimated_monthly_cost_usd": None}]}
    usage = await scheduler.call("GetUsage", service_pb2.GetUsageRequest(), key)
    listed = await scheduler.call("ListCheckpoints", service_pb2.ListCheckpointsRequest(), key)
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [{
        "project_id": None, "org_user_urn": f"temper:tenant:{usage.tenant}", "user_email": None, "user_name": usage.tenant,
        "checkpoint_count": len(listed.checkpoints), "size_bytes": usage.storage_bytes,
        "size_gigabytes": usage.storage_bytes / 1e9, "estimated_monthly_cost_usd": None}]}


@router.get("/whoami")
async def whoami(request: Request):
    key = api_key(request)
    keys = await gateway(request).scheduler.call("ListApiKeys", service_pb2.ListApiKeysRequest(), key)
    me = keys.caller
    return {"user_urn": f"temper:key:{me.prefix}", "org_urn": f"temper:tenant:{me.tenant}", "email": None,
            "tenant": me.tenant, "key_prefix": me.prefix, "is_admin": me.is_admin}
