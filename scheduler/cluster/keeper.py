"""Taking, renewing, releasing and listing lane leases in PostgreSQL.

Every time is the database's clock (``clock_timestamp()``, the server's wall clock at the statement,
not the transaction's start), so a replica that was paused, or whose clock is wrong, cannot keep a
lease alive in its own mind. Each call is one short transaction of its own.

Tokens: a lane's first lease has token 1, and every later taking adds one to the row's token. Rows
are never deleted (release expires a lease in place), so a token is never issued twice for a lane.
"""

from __future__ import annotations

import math

from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker

from temper.common.errors import InvalidArgument, LeaseLost
from temper.scheduler.cluster.lease import Lease
from temper.scheduler.db.outage import database_errors

LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock_timeout

# Taken when the lane has no row, or its lease has expired; a live lease, even the caller's own, is
# left alone (its owner renews it). After waiting for the row's lock, PostgreSQL re-checks the WHERE
# on the newest row version, so of racing takers exactly one sees it expired. The clock is read once
# (so expires_at - renewed_at is exactly the ttl), before any lock wait: a late taker's view of the
# old lease's expiry, and its own expiry, both err on the early side.
_ACQUIRE = text("""
    INSERT INTO lane_leases AS l (lane, owner, token, expires_at, renewed_at)
    SELECT :lane, :owner, 1, t.now + make_interval(secs => :ttl), t.now FROM (SELECT clock_timestamp() AS now) t
    ON CONFLICT (lane) DO UPDATE
        SET owner = excluded.owner, token = l.token + 1, expires_at = excluded.expires_at, renewed_at = excluded.renewed_at
        WHERE l.expires_at <= excluded.renewed_at
    RETURNING lane, owner, token, expires_at""")

# Only the holder of this very token renews, even after expiry if nobody took the lane since:
# nobody else wrote under a newer token, so extending it is still safe.
_RENEW = text("""
    UPDATE lane_leases SET expires_at = t.now + make_interval(secs => :ttl), renewed_at = t.now
    FROM (SELECT clock_timestamp() AS now) t
    WHERE lane = :lane AND owner = :owner AND token = :token
    RETURNING expires_at""")

# Expired in place (owner cleared, so neither renew nor fenced accepts the token again); the row
# stays so that the lane's next token counts on from this one.
_RELEASE = text("""
    UPDATE lane_leases SET owner = '', expires_at = clock_timestamp()
    WHERE lane = :lane AND owner = :owner AND token = :token""")

_OWNED = text("""
    SELECT lane, owner, token, expires_at, extract(epoch FROM expires_at - renewed_at) AS ttl
    FROM lane_leases WHERE owner = :owner AND expires_at > clock_timestamp() ORDER BY lane""")


@database_errors
class LeaseKeeper:
    """Lane leases on the scheduler's PostgreSQL database (``Store.sessions``). A replica's ``owner``
    id must be unique per process incarnation (a restarted replica is a new owner)."""

    def __init__(self, sessions: sessionmaker, lock_timeout: float = 1.0):
        if sessions.kw["bind"].dialect.name != "postgresql":
            raise InvalidArgument("scheduler replicas need PostgreSQL: lane leases rely on its row locks and clock")
        self.sessions = sessions
        # acquire gives up after this long behind another transaction on the lane's row (a fenced
        # write of the owner, or a racing taker): the lane is busy, so it is not free.
        self.lock_timeout_ms = max(1, math.ceil(lock_timeout * 1000))

    def acquire(self, lane: str, owner: str, ttl: float) -> Lease | None:
        """The lane's lease for ``owner`` with a new token, or None while another (or ``owner``
        itself) holds a live lease on it."""
        _check(lane, owner, ttl)
        try:
            with self.sessions.begin() as db:
                db.execute(text(f"SET LOCAL lock_timeout = {self.lock_timeout_ms}"))
                row = db.execute(_ACQUIRE, {"lane": lane, "owner": owner, "ttl": float(ttl)}).one_or_none()
        except OperationalError as exc:
            if getattr(exc.orig, "pgcode", None) == LOCK_NOT_AVAILABLE:
                return None
            raise
        return None if row is None else Lease(row.lane, row.owner, row.token, row.expires_at, float(ttl))

    def renew(self, lease: Lease, ttl: float | None = None) -> Lease:
        """``lease`` extended by ``ttl`` (default: its own) from the database's now; LeaseLost if the
        lane's row no longer has this owner and token."""
        ttl = lease.ttl if ttl is None else ttl
        _check(lease.lane, lease.owner, ttl)
        with self.sessions.begin() as db:
            expires_at = db.execute(_RENEW, _key(lease) | {"ttl": float(ttl)}).scalar_one_or_none()
        if expires_at is None:
            raise LeaseLost(lease.lane, lease.token, "another replica holds it, or it was released")
        return Lease(lease.lane, lease.owner, lease.token, expires_at, float(ttl))

    def release(self, lease: Lease) -> bool:
        """Give the lane up at once (a clean shutdown, or a rebalance). False if it was no longer held."""
        with self.sessions.begin() as db:
            return db.execute(_RELEASE, _key(lease)).rowcount == 1

    def owned_by(self, owner: str) -> list[Lease]:
        """``owner``'s live leases, by lane."""
        with self.sessions() as db:
            rows = db.execute(_OWNED, {"owner": owner}).all()
        return [Lease(r.lane, r.owner, r.token, r.expires_at, float(r.ttl)) for r in rows]

    def holder(self, lane: str):
        """(owner, token, live) of ``lane``'s row, or None: for the operator's view and tests."""
        with self.sessions() as db:
            return db.execute(text("SELECT owner, token, expires_at > clock_timestamp() AS live FROM lane_leases"
                                   " WHERE lane = :lane"), {"lane": lane}).one_or_none()


def _key(lease: Lease) -> dict:
    return {"lane": lease.lane, "owner": lease.owner, "token": lease.token}


def _check(lane: str, owner: str, ttl: float) -> None:
    if not lane or not owner:
        raise InvalidArgument("a lease needs a lane and an owner")
    if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl > 0):
        raise InvalidArgument(f"a lease's ttl must be a positive number of seconds, got {ttl!r}")
