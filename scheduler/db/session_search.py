"""Session search (issue 33; the SDK's ``RestClient.search_sessions``): the tenant's sessions that
match every filter given, newest first, paged by the last (created_at, id) of the previous page.
``SessionQuery`` is checked when built (``from_request``: INVALID_ARGUMENT for a malformed one);
``SessionSearchStore`` runs it. A mixin of ``Store``."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import NamedTuple

from sqlalchemy import and_, func, or_, select

from temper.common.errors import InvalidArgument
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import database_errors

# open: not closed; closed: any close status; the rest: that close status. "failed" is Tinker's and
# never set by Temper (it matches nothing), kept so the SDK's status filters all have a meaning here.
STATUSES = ("open", "closed", "success", "errored", "interrupted", "expired", "failed")
DEFAULT_LIMIT, MAX_LIMIT = 50, 200
MAX_WORDS = 16
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def unix_us(value: datetime) -> int:
    if value.tzinfo is None:  # SQLite hands back naive UTC
        value = value.replace(tzinfo=timezone.utc)
    return (value - EPOCH) // timedelta(microseconds=1)


@dataclass(frozen=True)
class SessionQuery:
    session_id: str = ""
    project_ids: tuple[str, ...] = ()
    user_metadata: dict[str, str] = field(default_factory=dict)
    words: tuple[str, ...] = ()   # of display_name, lower-cased
    statuses: tuple[str, ...] = ()
    limit: int = DEFAULT_LIMIT
    after: tuple[datetime, str] | None = None  # (created_at, session id) of the previous page's last

    @classmethod
    def from_request(cls, request) -> "SessionQuery":
        """From a ``SearchSessionsRequest``; InvalidArgument names the first bad field."""
        limit = request.limit or DEFAULT_LIMIT
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidArgument(f"limit must be in [1, {MAX_LIMIT}] (0: {DEFAULT_LIMIT}), got {request.limit}")
        unknown = sorted(set(request.statuses) - set(STATUSES))
        if unknown:
            raise InvalidArgument(f"unknown session status {unknown[0][:40]!r}: one of {', '.join(STATUSES)}")
        words = tuple(w.lower() for w in request.display_name.split())
        if request.display_name and not words:
            raise InvalidArgument("display_name must hold at least one word")
        if len(words) > MAX_WORDS:
            raise InvalidArgument(f"display_name holds at most {MAX_WORDS} words")
        after = None
        if request.after_session_id or request.after_created_unix_us:
            if not request.after_session_id or request.after_created_unix_us <= 0:
                raise InvalidArgument("a cursor needs both the last session's id and its creation time")
            after = (EPOCH + timedelta(microseconds=request.after_created_unix_us), request.after_session_id)
        return cls(request.session_id, tuple(dict.fromkeys(request.project_ids)), dict(request.user_metadata), words,
                   tuple(dict.fromkeys(request.statuses)), limit, after)


class SessionHit(NamedTuple):
    row: m.Session
    checkpoints: int
    checkpoint_bytes: int


def _status_clause(status: str):
    if status == "open":
        return m.Session.closed_at.is_(None)
    if status == "closed":
        return m.Session.closed_at.is_not(None)
    return m.Session.close_status == status


@database_errors
class SessionSearchStore:
    sessions = None  # sessionmaker, set by Store

    def search_sessions(self, tenant: str, query: SessionQuery) -> tuple[list[SessionHit], bool]:
        """One page of the tenant's matching sessions, newest first, each with its runs' listed
        checkpoints (count, bytes); and whether more follow. The caller checked the project ids."""
        s = m.Session
        clauses = [m.Tenant.name == tenant]
        if query.project_ids:
            clauses.append(s.project_id.in_(query.project_ids))
        for key, value in sorted(query.user_metadata.items()):
            clauses.append(s.user_metadata[key].as_string() == value)
        named = [func.lower(s.display_name).contains(word, autoescape=True) for word in query.words]
        if query.session_id and named:  # the SDK's rule: either one matches
            clauses.append(or_(s.id == query.session_id, and_(*named)))
        elif query.session_id:
            clauses.append(s.id == query.session_id)
        else:
            clauses.extend(named)
        if query.statuses:
            clauses.append(or_(*[_status_clause(status) for status in query.statuses]))
        if query.after is not None:
            created, last_id = query.after
            clauses.append(or_(s.created_at < created, (s.created_at == created) & (s.id < last_id)))
        statement = (select(s).join(m.Tenant, m.Tenant.id == s.tenant_id).where(*clauses)
                     .order_by(s.created_at.desc(), s.id.desc()).limit(query.limit + 1))
        with self.sessions() as db:
            rows = list(db.scalars(statement))
            page = rows[:query.limit]
            counts = {}
            if page:
                ck, run = m.Checkpoint, m.TrainingRun
                counts = {sid: (int(n), int(size or 0)) for sid, n, size in db.execute(
                    select(run.session_id, func.count(ck.id), func.sum(ck.size_bytes)).join(run, run.id == ck.training_run_id)
                    .where(run.session_id.in_([r.id for r in page]), ck.ephemeral.is_(False)).group_by(run.session_id))}
        return [SessionHit(r, *counts.get(r.id, (0, 0))) for r in page], len(rows) > query.limit
