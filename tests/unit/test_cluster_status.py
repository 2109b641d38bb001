"""GetClusterStatus from what the scheduler holds (fakes for the handles): each worker's state (up,
down, restoring), runs placed, each lane's queue and cycle count, fair share over the tenants with
work queued, and the ring of recent failures and recoveries (bounded, newest first). A tenant's key
is refused PERMISSION_DENIED."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from types import SimpleNamespace

import pytest

from temper.common.errors import PermissionDenied
from temper.scheduler.api.cluster_status import ClusterSources, ClusterStatusVerbs
from temper.scheduler.db.tenancy import KeyIdentity
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.scheduler.workers import events
from temper.scheduler.workers.events import ClusterEvents, CycleRate, cluster_event
from temper.v1 import service_pb2, trainer_pb2


def trainer(address: str, cycles: int = 0):
    rate = CycleRate()
    for _ in range(cycles):
        rate.ran()
    info = trainer_pb2.ModelInfo(base_model="m", incarnation=f"inc-{address}", device="cpu", device_memory_bytes=[100, 28])
    async def memory_used(timeout):
        assert timeout == 1.0
        return 64 if address == "t1" else 32

    return SimpleNamespace(address=address, info=info, cycles=rate, memory_used=memory_used)


def sampler(address: str, loaded: int, suspect_until: float = 0.0):
    return SimpleNamespace(address=address, info=SimpleNamespace(base_model="m", incarnation="s-inc", backend="torch"),
                           loaded=OrderedDict((f"k{i}", "t") for i in range(loaded)), suspect_until=suspect_until,
                           suspect=lambda now: now < suspect_until)


class Status(ClusterStatusVerbs):
    def __init__(self):
        self.backends = SimpleNamespace(trainers=[trainer("t1", cycles=3), trainer("t2"), trainer("t3")],
                                        samplers=[sampler("s1", 2), sampler("s2", 0)], down={"t2"},
                                        placements={"a:train:0": "t1", "b:train:0": "t1", "c:train:0": "t3"})
        self.admission = SimpleNamespace(queues={"a:train:0": [1, 2], "b:train:0": [3], "c:train:0": []},
                                         depth_by_tenant=lambda: {"alice": (3, 0), "carol": (0, 0)},
                                         quotas=SimpleNamespace(trained=SimpleNamespace(used=lambda tenant: 64.0)))
        self.store = SimpleNamespace(tenant_weights=lambda: {"alice": 3.0, "bob": 1.0, "carol": 1.0})
        members = {("sampler", "s2"): SimpleNamespace(down=True, last_seen=90.0), ("trainer", "t1"): SimpleNamespace(down=False, last_seen=99.5)}
        self.cluster = ClusterSources(SimpleNamespace(members=members, clock=lambda: 100.0),
                                      SimpleNamespace(pending={"c:train:0": "trainer t3 restarted"}))


def status_as(identity: KeyIdentity) -> service_pb2.ClusterStatus:
    token = set_caller(identity.tenant, identity)
    try:
        return asyncio.run(Status().GetClusterStatus(service_pb2.GetClusterStatusRequest(), None))
    finally:
        reset_caller(token)


def test_workers_lanes_and_fair_share(monkeypatch):
    monkeypatch.setattr(events, "EVENTS", ClusterEvents())
    status = status_as(KeyIdentity("ops", 1, "tml-ops00000", True))
    workers = {w.address: w for w in status.workers}
    assert {a: w.state for a, w in workers.items()} == {"t1": "up", "t2": "down", "t3": "restoring", "s1": "up", "s2": "down"}
    assert (workers["t1"].runs_placed, workers["t3"].runs_placed, workers["s1"].runs_placed) == (2, 1, 2)
    assert workers["t1"].memory_capacity_bytes == 128 and workers["t1"].incarnation == "inc-t1"
    assert (workers["t1"].memory_used_bytes, workers["t2"].memory_used_bytes, workers["t3"].memory_used_bytes) == (64, 0, 32)
    assert workers["t1"].seconds_since_heard == pytest.approx(0.5) and workers["t2"].seconds_since_heard == -1.0
    assert [(lane.trainer_address, lane.queue_depth, lane.cycles_total) for lane in status.lanes] == [("t1", 3, 3), ("t2", 0, 0),
                                                                                                   ("t3", 0, 0)]
    assert status.lanes[0].cycles_per_minute == 3.0
    shares = {s.tenant: s for s in status.fair_share}
    assert shares["alice"].share == 1.0 and shares["alice"].queued_requests == 3 and shares["alice"].weight == 3.0
    assert shares["bob"].share == 0.0 and shares["carol"].queued_requests == 0
    assert shares["alice"].train_tokens_last_minute == 64.0


def test_events_are_bounded_and_newest_first(monkeypatch):
    ring = ClusterEvents(kept=3)
    monkeypatch.setattr(events, "EVENTS", ring)
    for i in range(5):
        cluster_event("failure" if i % 2 else "recovery", f"event {i}", worker=f"w{i}")
    assert [e.what for e in ring.newest_first()] == ["event 4", "event 3", "event 2"]
    status = status_as(KeyIdentity("ops", 1, "tml-ops00000", True))
    assert [(e.kind, e.what, e.worker) for e in status.events] == [("recovery", "event 4", "w4"), ("failure", "event 3", "w3"),
                                                                   ("recovery", "event 2", "w2")]
    with pytest.raises(AssertionError):
        cluster_event("oops", "not a kind")


def test_a_tenants_key_is_refused():
    with pytest.raises(PermissionDenied, match="needs an admin key"):
        status_as(KeyIdentity("alice", 7, "tml-alice000", False))
