"""The audit log and the caller's own API keys, on the public API.

GetAuditLog: a tenant's key reads its own tenant's entries, an admin key every tenant's (or one).
ListApiKeys / CreateApiKey / RevokeApiKey: the calling tenant's keys only (another tenant's key is
NOT_FOUND, as if it did not exist); an admin key may be made only by an admin. Each change is logged
in its own transaction (scheduler/db/audit.py). CreateAuthToken: a short-lived JWT for the calling key
(scheduler/tenancy/jwt_tokens.py), the Tinker SDK's default auth.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from temper.common.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from temper.common.strings import check_text
from temper.scheduler.db import models as m
from temper.scheduler.db.audit import AuditQuery, MAX_PAGE
from temper.scheduler.db.views import unix_ms
from temper.scheduler.tenancy.auth import caller_actor, caller_identity, caller_used_token, require_admin
from temper.v1 import service_pb2

DEFAULT_PAGE = 100
MAX_LABEL_CHARS = 128  # api_keys.label is String(128)
MAX_TENANT_CHARS = 128
MAX_KEY_REF_CHARS = 64  # an id, a prefix or a whole key (tml- + 43 characters)
MAX_UNIX_MS = 253402300799999  # 9999-12-31T23:59:59.999Z: what a datetime holds


def audit_query(request: service_pb2.GetAuditLogRequest, tenant: str, is_admin: bool) -> AuditQuery:
    """The request, checked, as a query: a tenant's key is held to its own tenant."""
    for name in ("from_unix_ms", "to_unix_ms"):
        if not 0 <= getattr(request, name) <= MAX_UNIX_MS:
            raise InvalidArgument(f"{name} must be in [0, {MAX_UNIX_MS}] (0: unbounded), got {getattr(request, name)}")
    if not 0 <= request.page_size <= MAX_PAGE:
        raise InvalidArgument(f"page_size must be in [0, {MAX_PAGE}] (0: {DEFAULT_PAGE}), got {request.page_size}")
    if request.page_token and not (request.page_token.isdigit() and len(request.page_token) <= 19):
        raise InvalidArgument("page_token is not one this service gave out (next_page_token of the page before)")
    if len(request.tenant) > MAX_TENANT_CHARS:
        raise InvalidArgument(f"tenant is {len(request.tenant)} characters long (at most {MAX_TENANT_CHARS})")
    check_text(request.tenant, "tenant", identifier=True)
    if is_admin:
        scope = request.tenant or None
    elif request.tenant and request.tenant != tenant:
        raise PermissionDenied("another tenant's audit log needs an admin key")
    else:
        scope = tenant
    return AuditQuery(tenant=scope, since=_time(request.from_unix_ms), until=_time(request.to_unix_ms),
                      action=request.action, before_id=int(request.page_token) if request.page_token else None,
                      limit=request.page_size or DEFAULT_PAGE).checked()


def entry_message(row: m.AuditEntry) -> service_pb2.AuditEntry:
    return service_pb2.AuditEntry(id=row.id, at_unix_ms=unix_ms(row.at), tenant=row.tenant, key_prefix=row.key_prefix,
                                  actor=row.actor, action=row.action, target=row.target,
                                  details={str(k): str(v) for k, v in (row.details or {}).items()})


def key_message(row: m.ApiKey, tenant: str) -> service_pb2.ApiKeyInfo:
    return service_pb2.ApiKeyInfo(id=row.id, prefix=row.prefix, tenant=tenant, label=row.label or "", is_admin=bool(row.is_admin),
                                  created_unix_ms=unix_ms(row.created_at), last_used_unix_ms=unix_ms(row.last_used_at),
                                  revoked_unix_ms=unix_ms(row.revoked_at))


def _time(ms: int) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc) if ms else None


class AuditVerbs:
    """Mixed into TemperServicer (``store`` comes from it; ``forget_key``, the auth cache's, from app.py)."""

    forget_key = None  # called with a revoked key's SHA-256 and id: this scheduler refuses it and its tokens from their next call
    tokens = None  # the auth's JwtKeys (app.py): CreateAuthToken signs with them

    async def GetAuditLog(self, request, context):
        identity = caller_identity()
        query = audit_query(request, identity.tenant, identity.is_admin)
        rows, more = await asyncio.to_thread(self.store.audit_entries, query)
        return service_pb2.GetAuditLogResponse(entries=[entry_message(r) for r in rows],
                                               next_page_token=str(rows[-1].id) if more and rows else "")

    async def ListApiKeys(self, request, context):
        identity = caller_identity()
        rows = await asyncio.to_thread(self.store.list_api_keys, identity.tenant)
        response = service_pb2.ListApiKeysResponse(keys=[key_message(row, tenant) for row, tenant in rows])
        mine = next((k for k in response.keys if k.id == identity.key_id), None)
        response.caller.CopyFrom(mine or service_pb2.ApiKeyInfo(tenant=identity.tenant, prefix=identity.prefix,
                                                                is_admin=identity.is_admin))
        return response

    async def CreateApiKey(self, request, context):
        identity = caller_identity()
        if len(request.label) > MAX_LABEL_CHARS:
            raise InvalidArgument(f"label is {len(request.label)} characters long (at most {MAX_LABEL_CHARS})")
        check_text(request.label, "label", identifier=True)
        if request.is_admin:
            require_admin("creating an admin key")
        key, row = await asyncio.to_thread(self.store.create_api_key, identity.tenant, request.label, request.is_admin,
                                           caller_actor())
        return service_pb2.CreateApiKeyResponse(api_key=key, key=key_message(row, identity.tenant))

    async def RevokeApiKey(self, request, context):
        identity = caller_identity()
        ref = request.key
        if not ref.strip():
            raise InvalidArgument("key must name a key: its id, its prefix or the whole key")
        if len(ref) > MAX_KEY_REF_CHARS:
            raise InvalidArgument(f"key is {len(ref)} characters long (at most {MAX_KEY_REF_CHARS})")
        check_text(ref, "key", identifier=True)
        row = await asyncio.to_thread(self.store.revoke_api_key, ref, identity.tenant, caller_actor())
        if self.forget_key is not None:
            self.forget_key(row.key_sha256, row.id)
        return key_message(row, identity.tenant)

    async def CreateAuthToken(self, request, context):
        if self.tokens is None:
            raise FailedPrecondition("this scheduler issues no tokens; send the API key itself")
        if caller_used_token():
            # a token minting its successor would outlive any lifetime; the key itself must ask
            raise PermissionDenied("a token cannot be exchanged for another: send the API key (tml-...) itself")
        token, expires_unix = await self.tokens.issue(caller_identity())
        return service_pb2.AuthToken(jwt=token, expires_unix_ms=int(expires_unix * 1000))
