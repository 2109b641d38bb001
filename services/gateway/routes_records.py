"""The SDK routes over what the scheduler keeps: sessions (``RestClient.list_sessions``,
``get_session``), checkpoint storage (``AdminClient.get_current_checkpoint_storage_usage``), and
``GET /api/v1/whoami`` (the caller's tenant and key prefix).

Shapes are the SDK's: ``ListSessionsResponse {sessions: [id]}``, ``GetSessionResponse
{training_run_ids, sampler_ids, user_metadata, display_name}``,
``CurrentCheckpointStorageUsageResponse {effective_rate_usd_per_gigabyte_month, data: [item]}`` and
``WhoamiResponse {user_urn, org_urn, email}``. A tenant sees only its own (another tenant's session
is 404, as a missing one). Temper has no projects: a ``project_id`` is refused (400). ``access_scope``
``accessible`` answers as ``owned``: another tenant's sessions are never readable.

The SDK's own ``whoami()`` reads a JWT's claims client-side and never calls a server (it raises
without JWT auth, which Temper's gateway keeps off); ``/api/v1/whoami`` answers the same shape for a
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
    listed = await gateway(request).scheduler.call("ListSessions", records_pb2.ListSessionsRequest(limit=limit, offset=offset), key)
    return {"sessions": [s.session_id for s in listed.sessions]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request):
    key = api_key(request)
    _scope(request)
    fields.text(session_id, "session_id")
    info = await gateway(request).scheduler.call("GetSession", records_pb2.GetSessionRequest(session_id=session_id), key)
    return {"training_run_ids": list(info.training_run_ids), "sampler_ids": list(info.sampler_ids),
            "user_metadata": dict(info.user_metadata) or None, "display_name": None}


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(request: Request):
    key = api_key(request)
    if request.query_params.get("project_id"):
        raise invalid("Temper has no projects: leave project_id unset (the tenant's whole storage is answered)")
    scheduler = gateway(request).scheduler
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
