"""The check before a lane's durable write: ``fenced(db, lease)`` inside the writer's transaction.

It reads the lane's row FOR SHARE and raises LeaseLost unless the row still carries this owner and
token and is unexpired by the database's clock. The share lock is held to the transaction's end, and
a taker's UPDATE of the row must wait for it, so every write that passed the check commits before
any newer token exists: no write of a replica lands after another has taken its lane over.

A replica frozen inside such a transaction (SIGSTOP, a long GC) would hold the lock, and so the
lane, for as long as it is frozen. The transaction's idle limit is therefore the lease's ttl: past
it PostgreSQL ends the frozen replica's session, its uncommitted writes roll back, the lock goes,
and a survivor takes the lane. The limit stays set for the rest of the caller's transaction, on
purpose: any idle gap that long means the lease may be gone.
"""

from __future__ import annotations

import math

from sqlalchemy import text

from temper.common.errors import LeaseLost
from temper.scheduler.cluster.lease import Lease

_CHECK = text("""
    SELECT owner, token, expires_at > clock_timestamp() AS live
    FROM lane_leases WHERE lane = :lane FOR SHARE""")


def fenced(db, lease: Lease) -> None:
    """Raise LeaseLost, before the caller writes anything, unless ``lease`` still holds its lane.
    ``db`` is the caller's open Session or Connection on PostgreSQL; call this first in the
    transaction, before any of the lane's rows are written, and commit promptly."""
    idle_ms = max(1, math.ceil(lease.ttl * 1000))
    db.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"))
    row = db.execute(_CHECK, {"lane": lease.lane}).one_or_none()
    if row is None:
        raise LeaseLost(lease.lane, lease.token, "the lane has no lease")
    if row.token != lease.token or row.owner != lease.owner:
        raise LeaseLost(lease.lane, lease.token, f"the lane's lease is now token {row.token}"
                        + (f" of {row.owner!r}" if row.owner else " (released)"))
    if not row.live:
        raise LeaseLost(lease.lane, lease.token, "the lease expired by the database's clock")
