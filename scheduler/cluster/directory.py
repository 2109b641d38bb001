"""Who the replicas are and which owns each lane, as PostgreSQL says (table scheduler_replicas,
migration 0016; lane_leases, 0015). Every time is the database's clock. Each call is one short
transaction; the ownership loop (ownership.py) calls ``announce`` once a round and reads ``view``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.orm import sessionmaker

from temper.scheduler.db.outage import database_errors

_ANNOUNCE = text("""
    INSERT INTO scheduler_replicas AS r (owner, address, started_at, seen_at, stopped)
    SELECT :owner, :address, t.now, t.now, false FROM (SELECT clock_timestamp() AS now) t
    ON CONFLICT (owner) DO UPDATE SET seen_at = excluded.seen_at, address = excluded.address, stopped = false""")

_STOPPED = text("UPDATE scheduler_replicas SET stopped = true, seen_at = clock_timestamp() WHERE owner = :owner")

_REPLICAS = text("""
    SELECT owner, address, started_at, seen_at, stopped,
           NOT stopped AND seen_at > clock_timestamp() - make_interval(secs => :live_for) AS live,
           extract(epoch FROM clock_timestamp() - seen_at) AS silent_for
    FROM scheduler_replicas ORDER BY started_at, owner""")

_LANES = text("""
    SELECT lane, owner, token, expires_at > clock_timestamp() AS live,
           extract(epoch FROM clock_timestamp() - renewed_at) AS age,
           extract(epoch FROM expires_at - clock_timestamp()) AS left_for
    FROM lane_leases ORDER BY lane""")

# replicas silent this long, and stopped ones, are forgotten (their leases long expired)
_FORGET = text("""
    DELETE FROM scheduler_replicas
    WHERE seen_at < clock_timestamp() - make_interval(secs => :after)
      AND owner NOT IN (SELECT owner FROM lane_leases WHERE expires_at > clock_timestamp())""")


@dataclass(frozen=True)
class Replica:
    owner: str
    address: str
    started_at: datetime
    live: bool            # heard within the live window and not stopped
    silent_for: float     # seconds since it was last heard


@dataclass(frozen=True)
class LaneHolder:
    lane: str
    owner: str            # '' once released
    token: int
    live: bool
    age: float            # seconds since the lease was last taken or renewed
    left_for: float       # seconds until it expires (negative: expired)


@dataclass(frozen=True)
class ClusterView:
    replicas: list[Replica]
    lanes: list[LaneHolder]

    def live_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.live]

    def address_of(self, owner: str) -> str | None:
        return next((r.address for r in self.replicas if r.owner == owner), None)

    def holder(self, lane: str) -> LaneHolder | None:
        return next((h for h in self.lanes if h.lane == lane and h.live and h.owner), None)


@database_errors
class ReplicaDirectory:
    def __init__(self, sessions: sessionmaker):
        self.sessions = sessions

    def announce(self, owner: str, address: str) -> None:
        """This replica is alive at ``address`` (its row made or refreshed)."""
        with self.sessions.begin() as db:
            db.execute(_ANNOUNCE, {"owner": owner, "address": address})

    def stopped(self, owner: str) -> None:
        with self.sessions.begin() as db:
            db.execute(_STOPPED, {"owner": owner})

    def view(self, live_for: float) -> ClusterView:
        """Every replica (live: heard within ``live_for`` seconds) and every lane's lease, in one snapshot."""
        with self.sessions.begin() as db:
            replicas = [Replica(r.owner, r.address, r.started_at, bool(r.live), float(r.silent_for))
                        for r in db.execute(_REPLICAS, {"live_for": float(live_for)})]
            lanes = [LaneHolder(r.lane, r.owner, r.token, bool(r.live), float(r.age), float(r.left_for))
                     for r in db.execute(_LANES)]
        return ClusterView(replicas, lanes)

    def forget_silent(self, after: float) -> int:
        with self.sessions.begin() as db:
            return db.execute(_FORGET, {"after": float(after)}).rowcount
