"""The audit log: who (the acting key's prefix and tenant, or the admin command), what and when, for
every change a tenant or operator makes to keys, limits, checkpoints' visibility and life, imports and
sessions.

An entry is written by ``record`` inside the transaction of the change itself: the change and its
entry commit together or not at all, so no change goes unrecorded and a refused change leaves none.
The log is append-only: this module (and the Store) has no way to update or delete an entry, and
migration 0011 adds triggers with which the database itself refuses to.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session as DbSession

from temper.common.errors import InvalidArgument
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import database_errors

AUDIT_ACTIONS = ("api_key.create", "api_key.revoke", "quota.set", "checkpoint.save", "checkpoint.publish", "checkpoint.unpublish",
                 "checkpoint.ttl", "checkpoint.delete", "checkpoint.import", "checkpoint.copy", "session.open", "session.close",
                 "session.expire", "session.project", "project.create",
                 "image.upload", "image.delete")
ACTORS = ("api", "admin-command", "scheduler")
MAX_TARGET_CHARS = 512  # audit_log.target is String(512)
MAX_PAGE = 1000


@dataclass(frozen=True)
class Actor:
    """Who acts: a call with an API key (its prefix and tenant), the admin command, or the scheduler."""

    kind: str = "scheduler"
    key_prefix: str = ""
    tenant: str = ""  # the acting key's tenant ("" for the admin command and the scheduler)

    @classmethod
    def api(cls, key_prefix: str, tenant: str) -> "Actor":
        return cls("api", key_prefix, tenant)

    @classmethod
    def admin_command(cls) -> "Actor":
        return cls("admin-command")


SCHEDULER = Actor()


def record(db: DbSession, actor: Actor | None, action: str, tenant: str, target: str = "", **details) -> None:
    """Add the entry to ``db``'s transaction (the change's own). ``tenant``: whose object it is."""
    if action not in AUDIT_ACTIONS:
        raise AssertionError(f"unknown audit action {action!r}")  # a programming error, not a caller's
    actor = actor or SCHEDULER
    db.add(m.AuditEntry(tenant=tenant, key_prefix=actor.key_prefix, actor=actor.kind, action=action,
                        target=target[:MAX_TARGET_CHARS], details={k: _text(v) for k, v in details.items()}))


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat()
    return "" if value is None else str(value)


@dataclass(frozen=True)
class AuditQuery:
    """Which entries: ``tenant`` None is every tenant's (admins only: the API decides); times are
    [since, until); ``before_id`` pages (entries with a smaller id: older)."""

    tenant: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    action: str = ""
    before_id: int | None = None
    limit: int = 100

    def checked(self) -> "AuditQuery":
        if not 1 <= self.limit <= MAX_PAGE:
            raise InvalidArgument(f"page size must be in [1, {MAX_PAGE}], got {self.limit}")
        if self.action and self.action not in AUDIT_ACTIONS:
            raise InvalidArgument(f"unknown action {self.action[:40]!r}; known: {', '.join(AUDIT_ACTIONS)}")
        if self.since is not None and self.until is not None and self.until < self.since:
            raise InvalidArgument("the range ends before it starts")
        if self.before_id is not None and self.before_id < 1:
            raise InvalidArgument("bad page token")
        return self


@database_errors
class AuditStore:
    """A mixin of Store: reading the log. Writing is ``record``, inside each change's transaction."""

    sessions = None  # sessionmaker, set by Store

    def audit_entries(self, query: AuditQuery) -> tuple[list[m.AuditEntry], bool]:
        """Newest first, at most ``query.limit``; and whether older entries in the range remain."""
        query = query.checked()
        statement = select(m.AuditEntry).order_by(m.AuditEntry.id.desc()).limit(query.limit + 1)
        if query.tenant is not None:
            statement = statement.where(m.AuditEntry.tenant == query.tenant)
        if query.since is not None:
            statement = statement.where(m.AuditEntry.at >= query.since)
        if query.until is not None:
            statement = statement.where(m.AuditEntry.at < query.until)
        if query.action:
            statement = statement.where(m.AuditEntry.action == query.action)
        if query.before_id is not None:
            statement = statement.where(m.AuditEntry.id < query.before_id)
        with self.sessions() as db:
            rows = list(db.scalars(statement))
        return rows[:query.limit], len(rows) > query.limit
