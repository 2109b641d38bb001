"""A lane's lease, as its owner holds it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Lease:
    """``owner`` may write ``lane``'s rows while the lane's row in lane_leases still carries
    ``token`` (``fencing.fenced`` checks that in the writing transaction). ``expires_at`` is the
    database's clock, as the database last set it: a hint for when to renew, never a permission —
    only the database decides whether a lease is live. ``ttl`` is what renew extends it by."""

    lane: str
    owner: str
    token: int
    expires_at: datetime
    ttl: float
