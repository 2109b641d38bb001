"""GetClusterStatus's scheduler replicas (scheduler/api/cluster_status.py, replica_statuses): each
replica with the lanes whose lease names it, the answering one marked, and every lane exactly once:
a released lane, a lane of a forgotten owner and a trainer never leased are free lanes. One
scheduler (SoleOwner) reports replicated=false and no replicas."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from types import SimpleNamespace

from temper.scheduler.api import cluster_status
from temper.scheduler.api.cluster_status import ClusterStatusVerbs, replica_statuses
from temper.scheduler.cluster.directory import ClusterView, LaneHolder, Replica
from temper.scheduler.db.tenancy import KeyIdentity
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.v1 import service_pb2

STARTED = datetime(2025, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
VIEW = ClusterView(
    replicas=[Replica("r-a", "10.0.0.1:50051", STARTED, True, 0.4),
              Replica("r-b", "10.0.0.2:50051", STARTED, True, 0.9),
              Replica("r-dead", "10.0.0.3:50051", STARTED, False, 12.5)],
    lanes=[LaneHolder("t1", "r-a", 3, True, 0.5, 2.5),
           LaneHolder("t2", "r-b", 1, True, 1.0, 2.0),
           LaneHolder("t3", "r-dead", 2, False, 12.0, -9.0),    # its owner went silent: expired, not yet taken
           LaneHolder("t4", "", 5, False, 40.0, -37.0),         # released
           LaneHolder("t5", "r-forgotten", 1, False, 600.0, -597.0)])  # its owner's row is gone


def test_each_lane_once_under_its_replica_or_free():
    replicas, free = replica_statuses(VIEW, "r-b", ["t1", "t2", "t3", "t6"])
    assert [(r.owner, r.address, r.live, r.answering) for r in replicas] == [
        ("r-a", "10.0.0.1:50051", True, False), ("r-b", "10.0.0.2:50051", True, True),
        ("r-dead", "10.0.0.3:50051", False, False)]
    assert [[lane.trainer_address for lane in r.lanes] for r in replicas] == [["t1"], ["t2"], ["t3"]]
    assert replicas[2].seconds_since_heard == 12.5
    assert all(r.started_at_unix_ms == int(STARTED.timestamp() * 1000) for r in replicas)
    t1 = replicas[0].lanes[0]
    assert (t1.token, t1.live, t1.lease_age_seconds, t1.seconds_left) == (3, True, 0.5, 2.5)
    expired = replicas[2].lanes[0]
    assert (expired.token, expired.live, expired.seconds_left) == (2, False, -9.0)
    assert [(lane.trainer_address, lane.token, lane.live) for lane in free] == [("t4", 5, False), ("t5", 1, False),
                                                                               ("t6", 0, False)]
    every = [lane.trainer_address for r in replicas for lane in r.lanes] + [lane.trainer_address for lane in free]
    assert sorted(every) == ["t1", "t2", "t3", "t4", "t5", "t6"]


def test_a_naive_start_time_is_read_as_utc():
    naive = ClusterView([Replica("r", "h:1", STARTED.replace(tzinfo=None), True, 0.0)], [])
    replicas, free = replica_statuses(naive, "r", [])
    assert replicas[0].started_at_unix_ms == int(STARTED.timestamp() * 1000) and free == []


class OneScheduler(ClusterStatusVerbs):
    """No trainers or samplers; the servicer's default ownership (SoleOwner): nothing is read from a
    directory (the store below has no sessions to read one from)."""

    def __init__(self):
        self.backends = SimpleNamespace(trainers=[], samplers=[], down=set(), placements={})
        self.admission = SimpleNamespace(queues={}, depth_by_tenant=lambda: {},
                                         quotas=SimpleNamespace(trained=SimpleNamespace(used=lambda tenant: 0.0)))
        self.store = SimpleNamespace(tenant_weights=lambda: {})


def test_one_scheduler_is_not_replicated_and_lists_no_replicas():
    token = set_caller("ops", KeyIdentity("ops", 1, "tml-ops00000", True))
    try:
        status = asyncio.run(OneScheduler().GetClusterStatus(service_pb2.GetClusterStatusRequest(), None))
    finally:
        reset_caller(token)
    assert status.replicated is False
    assert list(status.replicas) == [] and list(status.free_lanes) == []


class ReplicaOne(OneScheduler):
    """A replica (owner r-b, leases of 3 s, live window 4.5 s) knowing trainers t1..t3 and t6."""

    def __init__(self):
        super().__init__()
        self.backends.trainers = [SimpleNamespace(address=a, info=None, cycles=None) for a in ("t1", "t2", "t3", "t6")]
        self.ownership = SimpleNamespace(replicated=True, owner="r-b", ttl=3.0, live_for=4.5, view=ClusterView([], []))
        self.store.sessions = "the store's sessions"


def test_a_replica_reads_the_view_fresh_from_the_directory(monkeypatch):
    asked = []

    class Directory:
        def __init__(self, sessions):
            self.sessions = sessions

        def view(self, live_for):
            asked.append((self.sessions, live_for))
            return VIEW

    monkeypatch.setattr(cluster_status, "ReplicaDirectory", Directory)
    replica = ReplicaOne()
    monkeypatch.setattr(replica, "_memory_used", lambda: asyncio.sleep(0, {}))
    monkeypatch.setattr(replica, "_worker_statuses", lambda memory_used: [])
    monkeypatch.setattr(replica, "_lane_statuses", lambda: [])
    token = set_caller("ops", KeyIdentity("ops", 1, "tml-ops00000", True))
    try:
        status = asyncio.run(replica.GetClusterStatus(service_pb2.GetClusterStatusRequest(), None))
    finally:
        reset_caller(token)
    assert asked == [("the store's sessions", 4.5)], "read now (not the cached view), live by the ownership's window"
    assert status.replicated is True
    assert [(r.owner, r.answering, len(r.lanes)) for r in status.replicas] == [("r-a", False, 1), ("r-b", True, 1),
                                                                               ("r-dead", False, 1)]
    assert [lane.trainer_address for lane in status.free_lanes] == ["t4", "t5", "t6"]
