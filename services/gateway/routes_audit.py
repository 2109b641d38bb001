"""The SDK's ``AdminClient.get_audit_log`` route: ``GET /api/v1/audit?event_type=...&day=YYYY-MM-DD``.

The answer is the SDK's ``AuditLogResponse``: ``{"entries": [{timestamp, event, event_details,
model_id?, tinker_path?}]}``, oldest first, for one UTC day (default today). The entries are the
scheduler's audit log (GetAuditLog): a tenant's key sees its own tenant's, an admin key every
tenant's. ``event`` is Tinker's ``<resource>_<action>`` spelling of Temper's action
(``checkpoint.publish`` -> ``checkpoint_publish``); ``event_details`` says who (tenant, key prefix,
actor), what (action, target) and the entry's details. ``event_type``: ``checkpoints`` (checkpoint
events), ``organizations`` (keys and limits: a Temper tenant is Tinker's organization), ``projects``
(a project made, a session moved into one), ``all``; Temper has no teams, so those answer no
entries. A day with more than ``MAX_ENTRIES`` entries is refused (400, naming the command that pages
through it), never built in memory.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone

from fastapi import APIRouter, Request

from temper.services.gateway.app import api_key, gateway
from temper.services.gateway.errors import invalid
from temper.v1 import service_pb2

router = APIRouter(prefix="/api/v1")
EVENT_TYPES = {"all": None, "checkpoints": ("checkpoint.",), "organizations": ("api_key.", "quota."),
               "projects": ("project.", "session.project"), "teams": ()}
PAGE = 1000          # GetAuditLog's largest page
MAX_ENTRIES = 10_000  # one day's answer at most: more is refused, not built


def _day(raw: str | None) -> date:
    if raw is None:
        return datetime.now(timezone.utc).date()
    try:
        if len(raw) != 10:
            raise ValueError
        return date.fromisoformat(raw)
    except ValueError:
        raise invalid(f"day must be a date YYYY-MM-DD, got {raw[:40]!r}") from None


def sdk_entry(entry: service_pb2.AuditEntry) -> dict:
    """One entry in the SDK's AuditLogEntry shape."""
    details = {"tenant": entry.tenant, "key_prefix": entry.key_prefix, "actor": entry.actor, "action": entry.action,
               "target": entry.target, "id": entry.id, **dict(entry.details)}
    out = {"timestamp": datetime.fromtimestamp(entry.at_unix_ms / 1000, tz=timezone.utc).isoformat(),
           "event": entry.action.replace(".", "_"), "event_details": details}
    if entry.action.startswith("checkpoint.") and entry.target.startswith("tinker://"):
        out["tinker_path"] = entry.target
        out["model_id"] = entry.target.removeprefix("tinker://").split("/", 1)[0]
    return out


@router.get("/audit")
async def get_audit_log(request: Request):
    key = api_key(request)
    event_type = request.query_params.get("event_type", "all")
    if event_type not in EVENT_TYPES:
        raise invalid(f"event_type must be one of {', '.join(EVENT_TYPES)}, got {event_type[:40]!r}")
    day = _day(request.query_params.get("day"))
    start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    prefixes = EVENT_TYPES[event_type]
    if prefixes == ():
        return {"entries": []}
    message = service_pb2.GetAuditLogRequest(from_unix_ms=int(start.timestamp() * 1000),
                                             to_unix_ms=int((start + timedelta(days=1)).timestamp() * 1000), page_size=PAGE)
    found: list[service_pb2.AuditEntry] = []
    while True:
        page = await gateway(request).scheduler.call("GetAuditLog", message, key)
        found.extend(e for e in page.entries if prefixes is None or e.action.startswith(prefixes))
        if len(found) > MAX_ENTRIES:
            raise invalid(f"more than {MAX_ENTRIES} audit entries on {day}: read them a page at a time with "
                          "`python -m temper.scheduler.admin audit-log` or the console's audit page")
        if not page.next_page_token:
            break
        message.page_token = page.next_page_token
    return {"entries": [sdk_entry(e) for e in reversed(found)]}  # oldest first, as Tinker sorts them
