"""Signing keys: HMAC secrets for short-lived tokens, shared by every scheduler replica via the database.

Each ``purpose`` ("jwt" for the Tinker SDK's auth exchange, "download" for signed URLs) has its own
keys, numbered by ``generation``; the newest is the current one, used to sign. ``current_key`` makes
a new one when there is none or the newest is older than ``rotate_after_seconds``. The row's
(purpose, generation) is unique and the insert is ON CONFLICT DO NOTHING, so two replicas rotating at
once both end up with the one key that won (never two "current" keys that refuse each other's tokens).

Older keys stay readable with ``key_by_id``: a token signed just before a rotation must still verify
until it expires. Callers pass ``max_age_seconds`` (rotation period + token lifetime) to stop
accepting keys past any token they could have signed. Rows are tiny (one per rotation period), so
none are deleted here.

Functions take a SQLAlchemy session and leave committing to the caller's transaction.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from temper.scheduler.db import models as m

SECRET_BYTES = 32  # HMAC-SHA256's block-size-appropriate key length


@dataclass(frozen=True)
class SigningKey:
    kid: str
    secret: bytes
    purpose: str
    created_unix: float

    def __repr__(self) -> str:  # never the secret in a log line
        return f"SigningKey(kid={self.kid!r}, purpose={self.purpose!r}, created_unix={self.created_unix})"


def _unix(value: datetime) -> float:
    # SQLite hands back naive datetimes; every one written here is UTC
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()


def _signing_key(row: m.SigningKey) -> SigningKey:
    return SigningKey(kid=row.kid, secret=bytes(row.secret), purpose=row.purpose, created_unix=_unix(row.created_at))


def _newest(session: Session, purpose: str) -> m.SigningKey | None:
    return session.scalar(select(m.SigningKey).where(m.SigningKey.purpose == purpose)
                          .order_by(m.SigningKey.generation.desc()).limit(1))


def _insert_unless_taken(session: Session, values: dict) -> None:
    """INSERT ... ON CONFLICT DO NOTHING: losing the race to another replica is not an error."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        statement = postgresql.insert(m.SigningKey).values(**values).on_conflict_do_nothing()
    elif dialect == "sqlite":
        statement = sqlite.insert(m.SigningKey).values(**values).on_conflict_do_nothing()
    else:
        raise RuntimeError(f"signing keys support PostgreSQL and SQLite, not {dialect}")
    session.execute(statement)


def current_key(session: Session, purpose: str, rotate_after_seconds: float) -> SigningKey:
    """The key to sign with now: the newest of ``purpose``, or a new one if there is none or it is
    older than ``rotate_after_seconds``. Concurrent callers (other replicas) agree on one key."""
    if not purpose:
        raise ValueError("a signing key needs a purpose")
    if rotate_after_seconds <= 0:
        raise ValueError(f"rotate_after_seconds must be > 0, not {rotate_after_seconds}")
    newest = _newest(session, purpose)
    if newest is not None and time.time() - _unix(newest.created_at) < rotate_after_seconds:
        return _signing_key(newest)
    generation = 0 if newest is None else newest.generation + 1
    _insert_unless_taken(session, {"kid": secrets.token_hex(8), "purpose": purpose, "generation": generation,
                                   "secret": secrets.token_bytes(SECRET_BYTES),
                                   "created_at": datetime.now(timezone.utc)})
    session.flush()
    # ours, or the one another replica inserted first for this generation (committed, so visible now)
    won = session.scalar(select(m.SigningKey).where(m.SigningKey.purpose == purpose,
                                                    m.SigningKey.generation == generation))
    if won is None:  # cannot happen: the insert either landed or conflicted with a committed row
        raise RuntimeError(f"no {purpose} signing key of generation {generation} after inserting one")
    return _signing_key(won)


def key_by_id(session: Session, purpose: str, kid: str, max_age_seconds: float | None = None) -> SigningKey | None:
    """The key ``kid`` of ``purpose`` (the current one or an older one), or None: unknown, of another
    purpose, or (with ``max_age_seconds``) made longer ago than that, so nothing it signed is still valid."""
    row = session.scalar(select(m.SigningKey).where(m.SigningKey.kid == kid, m.SigningKey.purpose == purpose))
    if row is None:
        return None
    key = _signing_key(row)
    if max_age_seconds is not None and time.time() - key.created_unix > max_age_seconds:
        return None
    return key
