"""The console's key, audit and operator routes: who the caller is (tenant, key prefix, admin), the
tenant's own API keys (create, revoke), its audit log (every tenant's for an admin key) and, for
admin keys only, the cluster's status: workers, lanes, the scheduler replicas and their lane leases
(PERMISSION_DENIED -> 403 for a tenant key)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from temper.services.gateway import fields
from temper.services.gateway.app import api_key
from temper.services.gateway.console import forms
from temper.services.gateway.console.api_tenant import call, query_int
from temper.services.gateway.console.views import view
from temper.v1 import service_pb2

router = APIRouter(prefix="/console/api")


@router.get("/me")
async def me(request: Request):
    keys = await call(request, "ListApiKeys", service_pb2.ListApiKeysRequest())
    usage = await call(request, "GetUsage", service_pb2.GetUsageRequest())
    return {"tenant": usage.tenant, "key_prefix": keys.caller.prefix, "is_admin": keys.caller.is_admin}


@router.get("/keys")
async def keys(request: Request):
    listed = await call(request, "ListApiKeys", service_pb2.ListApiKeysRequest())
    return {"keys": [view(k) for k in listed.keys], "caller": view(listed.caller)}


@router.post("/keys/create")
async def create_key(request: Request):
    api_key(request)
    form = await forms.read(request, forms.CreateKeyForm)
    made = await call(request, "CreateApiKey", service_pb2.CreateApiKeyRequest(label=form.label))
    return {"api_key": made.api_key, "key": view(made.key)}  # shown once, as CreateApiKey answers it


@router.post("/keys/revoke")
async def revoke_key(request: Request):
    api_key(request)
    form = await forms.read(request, forms.RevokeKeyForm)
    return view(await call(request, "RevokeApiKey", service_pb2.RevokeApiKeyRequest(key=form.prefix)))


@router.get("/audit")
async def audit(request: Request):
    api_key(request)
    message = service_pb2.GetAuditLogRequest(
        from_unix_ms=query_int(request, "from_unix_ms", 0, 0, fields.INT64[1]),
        to_unix_ms=query_int(request, "to_unix_ms", 0, 0, fields.INT64[1]),
        page_size=query_int(request, "page_size", 100, 1, 1000),
        page_token=fields.text(request.query_params.get("page_token", ""), "page_token"),
        tenant=fields.text(request.query_params.get("tenant", ""), "tenant"),
        action=fields.text(request.query_params.get("action", ""), "action"))
    page = await call(request, "GetAuditLog", message)
    return {"entries": [view(e) for e in page.entries], "next_page_token": page.next_page_token}


@router.get("/cluster")
async def cluster(request: Request):
    return view(await call(request, "GetClusterStatus", service_pb2.GetClusterStatusRequest()))
