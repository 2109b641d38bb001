"""The SDK's session search (``RestClient.search_sessions``, ``POST /api/v1/sessions/search``) in
the scheduler's terms: ``search_request`` checks a ``SessionSearchRequest`` body and builds the
``SearchSessionsRequest``; ``summary`` and ``next_cursor`` turn the answer into the SDK's
``SessionSummary`` and ``SessionSearchCursor``. A malformed body raises ValueError naming the field
(the route's 400); nothing is asked of the scheduler then.

Statuses, Tinker's to Temper's: ``active`` is an open session; ``client_finished`` (with ``reasons``:
success, errored, interrupted) one its client closed; ``cancelled`` one the scheduler closed because
its heartbeats stopped (close status ``expired``); ``failed`` matches none (Temper never fails a
session). Owners: a tenant sees only its own sessions, so ``own`` and ``accessible`` search the same
set, and ``user`` matches when its ``owner_urns`` name the caller's tenant (a session's ``owner``).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from temper.common.strings import MAX_ID_CHARS
from temper.v1 import records_pb2

DEFAULT_LIMIT, MAX_LIMIT = 50, 200
FINISH_REASONS = ("success", "errored", "interrupted")
STATUS_TYPES = ("active", "cancelled", "failed", "client_finished")
OWNER_TYPES = ("own", "accessible", "user")
MAX_PROJECTS = 100
_FIELDS = {"session_id", "project_ids", "user_metadata", "display_name", "owner", "statuses", "limit", "cursor"}
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _strings(value: Any, field: str, lo: int = 0, hi: int = MAX_PROJECTS) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and 0 < len(v) <= MAX_ID_CHARS for v in value):
        raise ValueError(f"{field} must be a list of non-empty strings")
    if not lo <= len(value) <= hi:
        raise ValueError(f"{field} lists {lo} to {hi} entries")
    return value


def _statuses(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValueError("statuses must be a non-empty list (leave it unset for every status)")
    out: list[str] = []
    for i, status in enumerate(value):
        kind = status.get("type") if isinstance(status, dict) else None
        if kind not in STATUS_TYPES:
            raise ValueError(f"statuses[{i}].type must be one of {', '.join(STATUS_TYPES)}")
        extra = set(status) - ({"type", "reasons"} if kind == "client_finished" else {"type"})
        if extra:
            raise ValueError(f"statuses[{i}] of type {kind!r} takes no field {sorted(extra)[0]!r}")
        if kind == "active":
            out.append("open")
        elif kind == "cancelled":
            out.append("expired")
        elif kind == "failed":
            out.append("failed")
        else:
            reasons = status.get("reasons")
            if reasons is None:
                out.extend(FINISH_REASONS)
            else:
                if not isinstance(reasons, list) or not reasons or any(r not in FINISH_REASONS for r in reasons):
                    raise ValueError(f"statuses[{i}].reasons must be a non-empty list of {', '.join(FINISH_REASONS)}")
                out.extend(reasons)
    return list(dict.fromkeys(out))


def _cursor(value: Any) -> tuple[int, str]:
    if not isinstance(value, dict) or set(value) != {"last_created_at", "last_session_id"}:
        raise ValueError("cursor must be a previous response's next_cursor (last_created_at, last_session_id)")
    created, session_id = value["last_created_at"], value["last_session_id"]
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_ID_CHARS:
        raise ValueError("cursor.last_session_id must be a session id")
    try:
        when = datetime.fromisoformat(created) if isinstance(created, str) else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise ValueError("cursor.last_created_at must be an ISO 8601 date-time with a time zone")
    return (when - EPOCH) // timedelta(microseconds=1), session_id


def search_request(body: Mapping[str, Any]) -> tuple[records_pb2.SearchSessionsRequest, tuple[str, ...]]:
    """The scheduler's request, and the owner names a ``user`` owner asks for (empty: the caller's own)."""
    if not isinstance(body, Mapping):
        raise ValueError("the body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown session search fields: {', '.join(unknown)}")
    out = records_pb2.SearchSessionsRequest(limit=DEFAULT_LIMIT)
    session_id = body.get("session_id")
    if session_id is not None:
        if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_ID_CHARS:
            raise ValueError("session_id must be a session id")
        out.session_id = session_id
    if body.get("project_ids") is not None:
        out.project_ids.extend(dict.fromkeys(_strings(body["project_ids"], "project_ids")))
    metadata = body.get("user_metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("user_metadata must map strings to strings")
    out.user_metadata.update(metadata)
    name = body.get("display_name")
    if name is not None:
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_ID_CHARS:
            raise ValueError(f"display_name must be a non-blank string of at most {MAX_ID_CHARS} characters")
        out.display_name = name
    if body.get("statuses") is not None:
        out.statuses.extend(_statuses(body["statuses"]))
    owner = body.get("owner") or {"type": "own"}
    kind = owner.get("type", "own") if isinstance(owner, dict) else None
    if kind not in OWNER_TYPES:
        raise ValueError(f"owner.type must be one of {', '.join(OWNER_TYPES)}")
    owners: tuple[str, ...] = ()
    if kind == "user":
        owners = tuple(_strings(owner.get("owner_urns"), "owner.owner_urns", 1, 10))
    elif set(owner) - {"type"}:
        raise ValueError(f"owner of type {kind!r} takes no other fields")
    limit = body.get("limit", DEFAULT_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}")
    out.limit = limit
    if body.get("cursor") is not None:
        out.after_created_unix_us, out.after_session_id = _cursor(body["cursor"])
    return out, owners


def _time(unix_us: int) -> str:
    return (EPOCH + timedelta(microseconds=unix_us)).isoformat()


def status(info: records_pb2.SessionInfo) -> dict | None:
    """The SDK's ``SessionStatus`` of a session."""
    if not info.closed:
        return {"type": "active"}
    if info.close_status == "expired":
        return {"type": "cancelled", "detail": "expired: no heartbeat within the scheduler's session_expire_seconds"}
    if info.close_status in FINISH_REASONS:
        return {"type": "client_finished", "reason": {"type": info.close_status}}
    return None


def summary(info: records_pb2.SessionInfo, tenant: str) -> dict:
    return {"session_id": info.session_id, "created_at": _time(info.created_unix_us), "owner": tenant,
            "project_id": info.project_id, "status": status(info), "checkpoints_count": info.checkpoints_count,
            "display_name": info.display_name or None, "user_metadata": dict(info.user_metadata) or None,
            "checkpoint_storage_bytes": info.checkpoint_bytes}


def next_cursor(answer: records_pb2.SearchSessionsResponse) -> dict | None:
    if not answer.more or not answer.sessions:
        return None
    last = answer.sessions[-1]
    return {"last_created_at": _time(last.created_unix_us), "last_session_id": last.session_id}
