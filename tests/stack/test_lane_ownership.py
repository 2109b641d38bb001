"""Lane ownership between scheduler replicas (scheduler/cluster/ownership.py, directory.py) on real
PostgreSQL, with no scheduler process, trainer or network: each replica is a LaneOwnership with fake
hooks, and the tests drive its rounds by hand. Covered: the fair share (lanes split as replicas join,
idle surplus given up, busy lanes kept), the order of the hooks, route(), takeover of a silent
replica's lanes after its leases expire (and its LeaseLost after), fence_runs in a real write
transaction, a clean stop(), and a database outage that run_forever survives. Lease expiry is the
database's clock, so the few waits poll the database until it says a lease has expired."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest
from sqlalchemy import func, select, text

from temper.common.errors import LeaseLost, Unavailable
from temper.scheduler.cluster.directory import ReplicaDirectory
from temper.scheduler.cluster.keeper import LeaseKeeper
from temper.scheduler.cluster.ownership import SURPLUS_ROUNDS, LaneOwnership
from temper.scheduler.db import models as m
from temper.scheduler.db.store import Store, upgrade_schema
from test_faults import FlakyProxy, tcp_upstream

TTL = 1.0  # seconds: for the tests that wait for a lease to expire by the database's clock (kept quick)
LONG = 10.0  # for the others: no lease runs out under them even on a loaded machine
LANES = [f"trainer-{i}:50051" for i in range(3)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeHooks:
    """The planning layer as LaneOwnership sees it; records each call with what was true at the time."""

    def __init__(self, lanes: list[str], keeper: LeaseKeeper, placed: dict[str, str]):
        self.all, self.keeper, self.placed = list(lanes), keeper, placed
        self.busy: set[str] = set()
        self.ownership: LaneOwnership | None = None
        self.gained_calls: list[tuple] = []     # (lane, holds() then, the database's (owner, live) then)
        self.releasing_calls: list[tuple] = []
        self.health_calls: list[bool] = []

    def lanes(self) -> list[str]:
        return self.all

    def lane_of(self, run_id: str) -> str | None:
        return self.placed.get(run_id)

    def idle(self, lane: str) -> bool:
        return lane not in self.busy

    def gained(self, lane: str) -> None:
        self.gained_calls.append((lane, self.ownership.holds(lane), self._row(lane)))

    def releasing(self, lane: str) -> None:
        self.releasing_calls.append((lane, self.ownership.holds(lane), self._row(lane)))

    def health(self, serving: bool) -> None:
        self.health_calls.append(serving)

    def _row(self, lane: str) -> tuple:
        row = self.keeper.holder(lane)
        return (row.owner, bool(row.live))


@pytest.fixture(scope="module")
def store(new_postgres_database):
    url = new_postgres_database("temper_ownership")
    upgrade_schema(url)
    store = Store(url)
    store.url = url
    yield store
    store.engine.dispose()


@pytest.fixture
def cluster(store):
    """A callable that makes a replica on a clean database (no replicas, no leases), sharing run placements."""
    with store.engine.begin() as conn:
        conn.execute(text("TRUNCATE lane_leases, scheduler_replicas"))
    placed: dict[str, str] = {}

    def replica(name: str, lanes=LANES, ttl: float = LONG, on: Store = store, clock=None) -> LaneOwnership:
        keeper = LeaseKeeper(on.sessions, lock_timeout=0.5)
        hooks = FakeHooks(lanes, LeaseKeeper(store.sessions), placed)
        hooks.ownership = LaneOwnership(keeper, ReplicaDirectory(on.sessions), name, f"{name}.internal:50051", ttl,
                                        hooks, **({"clock": clock} if clock else {}))
        return hooks.ownership

    replica.placed = placed
    return replica


def in_loop(test):
    """Run an async test in its own event loop (the project does not use pytest-asyncio); 30 s at most."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 30))
    return run


async def settle(*replicas: LaneOwnership, rounds: int = SURPLUS_ROUNDS + 2) -> None:
    for _ in range(rounds):
        for replica in replicas:
            await replica.round()


def held(replica: LaneOwnership) -> list[str]:
    return sorted(lane for lane in replica.leases if replica.holds(lane))


def owner_token(replica: LaneOwnership, lane: str) -> tuple:
    row = replica.keeper.holder(lane)
    return (row.owner, row.token, bool(row.live))


async def until_expired(replica: LaneOwnership, lane: str, *renewing: LaneOwnership, by: float = 0.0) -> None:
    """Wait (polling, never sleeping a fixed time) until the database's clock says the lane's lease
    expired ``by`` seconds ago (or another took it meanwhile), while ``renewing`` keep running rounds."""
    first = owner_token(replica, lane)[:2]
    query = text("SELECT owner, token, extract(epoch FROM clock_timestamp() - expires_at) AS expired_for"
                 " FROM lane_leases WHERE lane = :lane")
    while True:
        with replica.keeper.sessions() as db:
            row = db.execute(query, {"lane": lane}).one()
        if (row.owner, row.token) != first or row.expired_for > by:
            return
        await settle(*renewing, rounds=1)
        await asyncio.sleep(0.05)


async def until_health(replica: LaneOwnership, serving: bool) -> None:
    while replica.hooks.health_calls[-1:] != [serving]:
        await asyncio.sleep(0.02)


# ---- the fair share ---------------------------------------------------------------------------


@in_loop
async def test_a_replica_alone_takes_every_lane_and_gives_an_idle_one_to_a_joiner(cluster):
    a = cluster("a", LANES[:2])
    await a.round()
    assert held(a) == LANES[:2]
    assert [owner_token(a, lane) for lane in LANES[:2]] == [("a", 1, True)] * 2
    # gained() ran once the database had the lease, but before this replica counted the lane as held
    assert a.hooks.gained_calls == [(lane, False, ("a", True)) for lane in LANES[:2]]
    assert a.hooks.releasing_calls == []

    b = cluster("b", LANES[:2])
    await b.round()  # its fair share is 1, but both lanes are held: it takes nothing yet
    assert held(b) == [] and held(a) == LANES[:2]
    for _ in range(SURPLUS_ROUNDS - 1):  # over its share, not yet for SURPLUS_ROUNDS rounds in a row: keeps both
        await a.round()
        assert held(a) == LANES[:2]
    await a.round()  # over its share by one for SURPLUS_ROUNDS rounds: gives up an idle lane (the last one)
    assert held(a) == [LANES[0]]
    # releasing() ran after the lane stopped counting as held, while the database still had the lease
    assert a.hooks.releasing_calls == [(LANES[1], False, ("a", True))]
    assert owner_token(a, LANES[1]) == ("", 1, False)
    await b.round()
    assert held(b) == [LANES[1]] and owner_token(b, LANES[1]) == ("b", 2, True)
    assert b.hooks.gained_calls == [(LANES[1], False, ("b", True))]
    await settle(a, b)
    assert (held(a), held(b)) == ([LANES[0]], [LANES[1]]), "settled: nothing changes hands again"


@in_loop
async def test_a_busy_lane_is_kept_and_an_idle_one_given_up_instead(cluster):
    a, b = cluster("a", LANES[:2]), cluster("b", LANES[:2])
    await a.round()
    a.hooks.busy = set(LANES[:2])  # work of both lanes' runs held here: over its share, a keeps them anyway
    await settle(b, a, b)
    assert (held(a), held(b)) == (LANES[:2], [])
    assert a.hooks.releasing_calls == []

    a.hooks.busy = {LANES[1]}  # the lane it would give up first is still busy: the idle one goes instead
    await settle(a, b)
    assert (held(a), held(b)) == ([LANES[1]], [LANES[0]])
    assert [call[0] for call in a.hooks.releasing_calls] == [LANES[0]]
    assert owner_token(b, LANES[0]) == ("b", 2, True)


@pytest.mark.parametrize("num_lanes, num_replicas, shares", [(2, 2, [1, 1]), (3, 2, [1, 2]), (2, 3, [0, 1, 1]),
                                                             (3, 3, [1, 1, 1])])
@in_loop
async def test_lanes_are_split_by_fair_share_as_replicas_join(cluster, num_lanes, num_replicas, shares):
    lanes = LANES[:num_lanes]
    replicas: list[LaneOwnership] = []
    for name in "abc"[:num_replicas]:
        replicas.append(cluster(name, lanes))
        await settle(*replicas)
    assert sorted(len(held(r)) for r in replicas) == shares
    assert all(len(held(r)) <= math.ceil(num_lanes / num_replicas) for r in replicas)
    taken = [lane for r in replicas for lane in held(r)]
    assert sorted(taken) == lanes, "every lane held, none twice"
    for r in replicas:
        assert all(owner_token(r, lane)[:1] == (r.owner,) for lane in held(r)), "the database agrees"


# ---- health, holds and route ------------------------------------------------------------------


@in_loop
async def test_run_forever_reports_serving_after_a_good_round(cluster):
    a = cluster("a", LANES[:1])
    task = asyncio.create_task(a.run_forever())
    await until_health(a, True)
    assert a.serving and a.hooks.health_calls == [True] and a.rounds >= 1 and held(a) == LANES[:1]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@in_loop
async def test_holds_is_a_hint_by_the_local_clock_measured_from_before_the_renewal(cluster):
    clock = FakeClock()
    a = cluster("a", LANES[:1], clock=clock)
    await a.round()
    lane = LANES[0]
    clock.now += a.ttl - 0.01
    assert a.holds(lane)
    clock.now += 0.02  # not renewed for a whole ttl by this process's clock: no longer counted as held
    assert not a.holds(lane)
    with pytest.raises(Unavailable):
        await a.route(lane)

    renew = a.keeper.renew

    def slow_renew(lease):  # a renewal that takes half a ttl: the lease runs from its start, at the latest
        clock.now += a.ttl / 2
        return renew(lease)

    a.keeper.renew = slow_renew
    renewed_from = clock.now
    await a.round()
    assert a.holds(lane) and owner_token(a, lane) == ("a", 1, True)
    clock.now = renewed_from + a.ttl + 0.01
    assert not a.holds(lane)


@in_loop
async def test_route_answers_none_for_an_own_lane_the_owners_address_else_and_unavailable_while_nobody_holds_it(cluster):
    a, b = cluster("a", LANES[:2], TTL), cluster("b", LANES[:2], TTL)
    await settle(a, b)
    assert (held(a), held(b)) == ([LANES[0]], [LANES[1]])
    assert await a.route(LANES[0]) is None
    assert await a.route(LANES[1]) == "b.internal:50051"
    assert await b.route(LANES[0]) == "a.internal:50051"

    # b stops renewing (no more rounds). Until its lease expires nobody else may take its lane, not
    # even c, which joins with room in its share.
    c = cluster("c", LANES[:2], TTL)
    await c.round()
    assert held(c) == [] and owner_token(c, LANES[1])[:2] == ("b", 2)
    assert await c.route(LANES[1]) == "b.internal:50051"
    a.hooks.all = LANES[:1]  # a renews meanwhile but cannot run trainer-1 (it would take the lane once free)
    await until_expired(a, LANES[1], a, by=0.2)  # 0.2 s: past what any view read before the expiry can still say
    for replica in (a, c):
        with pytest.raises(Unavailable):
            await replica.route(LANES[1])  # expired, and not yet taken by anyone
    await c.round()
    assert held(c) == [LANES[1]] and owner_token(c, LANES[1]) == ("c", 3, True)
    a.hooks.all = LANES[:2]
    await a.round()  # a's view is re-read once a round (and on a miss, at most every 0.1 s)
    assert held(a) == [LANES[0]]
    assert await a.route(LANES[1]) == "c.internal:50051"


# ---- takeover ---------------------------------------------------------------------------------


@in_loop
async def test_a_silent_replicas_lanes_are_taken_after_its_leases_expire_and_it_must_stop(cluster):
    a, b = cluster("a", LANES[:2], TTL), cluster("b", LANES[:2], TTL)
    dying = asyncio.create_task(a.run_forever())
    await until_health(a, True)
    await settle(b, rounds=1)
    while held(b) != [LANES[1]]:  # a's rounds give up its surplus, b's take it
        await asyncio.sleep(0.05)
        await b.round()
    assert held(a) == [LANES[0]]
    dying.cancel()  # a dies: no more rounds, its lease left to run out
    await asyncio.gather(dying, return_exceptions=True)

    await b.round()
    assert held(b) == [LANES[1]], "a's lease is still live: b may not take it"
    await until_expired(b, LANES[0], b)
    await b.round()  # a silent for a ttl counts as gone: b's share is now every lane
    assert held(b) == LANES[:2]
    assert owner_token(b, LANES[0]) == ("b", 2, True)
    assert await b.route(LANES[0]) is None
    assert [r.owner for r in b.view.live_replicas()] == ["b"]

    with pytest.raises(LeaseLost):  # a comes back: its renewal fails and its loop ends, so the replica stops
        await a.run_forever()
    assert a.hooks.health_calls == [True, False] and not a.serving
    assert not a.holds(LANES[0]) and a.leases == {}
    await a.stop()  # as the scheduler does on its way out
    assert owner_token(b, LANES[0]) == ("b", 2, True), "neither the failed renewal nor the stop touched b's lease"
    await b.round()
    assert [(r.owner, r.live) for r in b.view.replicas] == [("a", False), ("b", True)]


# ---- fencing ----------------------------------------------------------------------------------


def tenants(store: Store, name: str) -> int:
    with store.sessions() as db:
        return db.scalar(select(func.count()).select_from(m.Tenant).where(m.Tenant.name == name))


def write(store: Store, ownership: LaneOwnership, runs: list[str], tenant: str) -> None:
    """A lane's durable write as the store makes it: fence_runs first, then the rows, in one transaction."""
    with store.engine.begin() as conn:
        ownership.fence_runs(conn, runs)
        conn.execute(m.Tenant.__table__.insert().values(name=tenant, weight=1.0))


@in_loop
async def test_fence_runs_passes_for_held_lanes_and_refuses_any_other(store, cluster):
    a, b = cluster("a", LANES[:2], TTL), cluster("b", LANES[:2], TTL)
    await settle(a, b)
    cluster.placed.update({"run-a1": LANES[0], "run-a2": LANES[0], "run-b": LANES[1]})
    write(store, a, ["run-a1", "run-a2"], "fenced-ok")
    write(store, b, ["run-b"], "fenced-ok-b")
    assert tenants(store, "fenced-ok") == tenants(store, "fenced-ok-b") == 1

    for runs in (["run-b"], ["run-a1", "run-b"], ["run-unplaced"]):  # another's lane, or no known lane
        with pytest.raises(LeaseLost):
            write(store, a, runs, "fenced-refused")
    assert tenants(store, "fenced-refused") == 0

    # a falls silent; b takes its lane. a still has the old lease in memory, but its token has moved on.
    await until_expired(a, LANES[0], b)
    await b.round()
    assert owner_token(b, LANES[0]) == ("b", 2, True) and LANES[0] in a.leases
    with pytest.raises(LeaseLost):
        write(store, a, ["run-a1"], "fenced-stale")
    assert tenants(store, "fenced-stale") == 0
    write(store, b, ["run-a1", "run-b"], "fenced-new-owner")
    assert tenants(store, "fenced-new-owner") == 1


# ---- stop -------------------------------------------------------------------------------------


@in_loop
async def test_stop_releases_every_lease_so_another_replica_takes_the_lanes_at_once(cluster):
    a, b = cluster("a", LANES), cluster("b", LANES)
    await a.round()
    await b.round()  # b has joined; every lane is still a's
    assert held(a) == LANES and held(b) == []
    await a.stop()
    assert a.leases == {} and not any(a.holds(lane) for lane in LANES)
    assert [owner_token(a, lane) for lane in LANES] == [("", 1, False)] * 3
    await b.round()  # at once: no lease to wait out, and a stopped replica is not in the fair share
    assert held(b) == LANES and [owner_token(b, lane) for lane in LANES] == [("b", 2, True)] * 3
    assert [(r.owner, r.live) for r in b.view.replicas] == [("a", False), ("b", True)]


# ---- a database outage ------------------------------------------------------------------------


@in_loop
async def test_a_database_outage_makes_the_replica_unhealthy_and_it_renews_when_the_database_returns(store, cluster):
    with FlakyProxy(tcp_upstream(store.url)) as proxy:
        through_proxy = Store(proxy.url(store.url))
        try:
            a = cluster("a", LANES[:1], TTL, on=through_proxy)
            loop = asyncio.create_task(a.run_forever())
            await until_health(a, True)
            assert held(a) == LANES[:1]

            await asyncio.to_thread(proxy.down)
            await until_health(a, False)
            assert not a.serving and not loop.done(), "an outage is not a lost lease: the loop goes on"
            await until_expired(cluster("observer"), LANES[0])  # through the real database: nobody took it
            await asyncio.to_thread(proxy.up)

            await until_health(a, True)
            assert a.hooks.health_calls == [True, False, True] and not loop.done()
            assert held(a) == LANES[:1]
            assert owner_token(a, LANES[0]) == ("a", 1, True), "the same lease renewed, not taken again"
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        finally:
            through_proxy.engine.dispose()
