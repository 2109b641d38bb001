"""Tinker 0.39's checkpoint search (``RestClient.search_checkpoints``), over the checkpoints a tenant
may list: the gateway's ``POST /api/v1/checkpoints/search`` and temper.client's RestClient share it.

The request is the SDK's ``CheckpointSearchRequest`` as JSON: ``user_metadata`` (every pair must
match the checkpoint's), ``checkpoint_type`` ("training" / "sampler"; "external" matches none here),
``base_models`` (any of them; an empty list matches none), ``owner`` ({"type": "own"} by default,
"accessible", or "user" with ``owner_urns``: the tenant names), ``project_ids`` (any of these projects' checkpoints;
the caller lists them with ``ListCheckpointsRequest.project_ids``, where a project not the caller's is
NOT_FOUND, as naming a project the caller cannot list is an error in Tinker),
``limit`` (1 to 200, default 50) and ``cursor``. Results are newest first; the cursor is the last
result's ``last_created_at`` and ``last_checkpoint_uuid`` (here its tinker path: pass it back unchanged).

A tenant lists only its own checkpoints (another tenant's published ones can be read by path, not
listed), so "own" and "accessible" search the same set.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

from temper.v1 import types_pb2

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
CHECKPOINT_TYPES = {"training": types_pb2.CHECKPOINT_KIND_TRAINING, "sampler": types_pb2.CHECKPOINT_KIND_SAMPLER,
                    "external": None}
OWNER_TYPES = ("own", "accessible", "user")
_FIELDS = {"project_ids", "user_metadata", "checkpoint_type", "owner", "base_models", "limit", "cursor"}


@dataclass(frozen=True)
class CheckpointQuery:
    user_metadata: Mapping[str, str]
    checkpoint_type: str | None = None
    base_models: tuple[str, ...] | None = None
    owner: str = "own"
    owner_urns: tuple[str, ...] = ()
    limit: int = DEFAULT_LIMIT
    after: tuple[int, str] | None = None  # the cursor: (created_unix_ms, tinker path) of the last result
    project_ids: tuple[str, ...] = ()  # the lister's filter (ListCheckpointsRequest.project_ids); empty: every project


def _strings(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field} must be a list of strings")
    return tuple(value)


def _cursor_ms(value: Any) -> int:
    if not isinstance(value, str):
        raise ValueError("cursor.last_created_at must be an ISO 8601 date-time")
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"cursor.last_created_at is not an ISO 8601 date-time: {value!r}") from None
    if when.tzinfo is None:
        raise ValueError("cursor.last_created_at must carry a time zone")
    return round(when.timestamp() * 1000)


def parse_query(body: Mapping[str, Any]) -> CheckpointQuery:
    """The SDK's request JSON, checked; a ValueError names what is wrong (the gateway's 400)."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown checkpoint search fields: {', '.join(unknown)}")
    projects = body.get("project_ids")
    projects = () if projects is None else tuple(dict.fromkeys(_strings(projects, "project_ids")))
    metadata = body.get("user_metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("user_metadata must map strings to strings")
    kind = body.get("checkpoint_type")
    if kind is not None and kind not in CHECKPOINT_TYPES:
        raise ValueError(f"checkpoint_type must be one of {', '.join(CHECKPOINT_TYPES)}; got {kind!r}")
    base_models = body.get("base_models")
    base_models = None if base_models is None else _strings(base_models, "base_models")
    owner = body.get("owner") or {"type": "own"}
    if not isinstance(owner, dict) or owner.get("type", "own") not in OWNER_TYPES:
        raise ValueError(f"owner.type must be one of {', '.join(OWNER_TYPES)}")
    owner_type = owner.get("type", "own")
    urns: tuple[str, ...] = ()
    if owner_type == "user":
        urns = _strings(owner.get("owner_urns"), "owner.owner_urns")
        if not 1 <= len(urns) <= 10:
            raise ValueError("owner.owner_urns lists 1 to 10 owners")
    elif set(owner) - {"type"}:
        raise ValueError(f"owner of type {owner_type!r} takes no other fields")
    limit = body.get("limit", DEFAULT_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}")
    cursor = body.get("cursor")
    after = None
    if cursor is not None:
        if not isinstance(cursor, dict) or not isinstance(cursor.get("last_checkpoint_uuid"), str):
            raise ValueError("cursor must be a previous response's next_cursor")
        after = (_cursor_ms(cursor.get("last_created_at")), cursor["last_checkpoint_uuid"])
    return CheckpointQuery(user_metadata=dict(metadata), checkpoint_type=kind, base_models=base_models,
                           owner=owner_type, owner_urns=urns, limit=limit, after=after, project_ids=projects)


def _newest_first(c: types_pb2.Checkpoint) -> tuple[int, str]:
    return (c.created_unix_ms, c.path)


def _matches(c: types_pb2.Checkpoint, q: CheckpointQuery) -> bool:
    if q.checkpoint_type is not None and c.kind != CHECKPOINT_TYPES[q.checkpoint_type]:
        return False
    if q.base_models is not None and c.base_model not in q.base_models:
        return False
    return all(c.user_metadata.get(k) == v for k, v in q.user_metadata.items())


def search(checkpoints: Iterable[types_pb2.Checkpoint], query: CheckpointQuery,
           caller: str | None = None) -> tuple[list[types_pb2.Checkpoint], dict | None]:
    """One page of the caller's matching ``checkpoints``, newest first (ties: by tinker path, descending),
    and the next page's cursor (None once exhausted). ``caller``: the tenant's name, for ``owner`` "user"."""
    if query.owner == "user" and (caller is None or caller not in query.owner_urns):
        return [], None
    found = sorted((c for c in checkpoints if _matches(c, query)), key=_newest_first, reverse=True)
    if query.after is not None:
        found = [c for c in found if _newest_first(c) < query.after]
    page = found[:query.limit]
    more = len(found) > query.limit
    return page, (cursor_of(page[-1]) if more else None)


def cursor_of(c: types_pb2.Checkpoint) -> dict:
    return {"last_created_at": datetime.fromtimestamp(c.created_unix_ms / 1000, tz=timezone.utc).isoformat(),
            "last_checkpoint_uuid": c.path}


def owner_of(runs: Sequence[Any]) -> str | None:
    """The tenant's name from its runs (TrainingRunInfo.owner); None without runs (then no checkpoints)."""
    return runs[0].owner if runs else None
