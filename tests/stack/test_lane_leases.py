"""Lane leases and fencing (issue 32; scheduler/cluster/) on real PostgreSQL, migrated to head: one
owner per lane at a time, tokens strictly increasing per lane, expiry by the database's clock only,
and no write of a replica that lost its lease — checked, then written, or neither — including a
replica frozen past its lease, before and inside its writing transaction. No model, no services."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError

from temper.common.errors import InvalidArgument, LeaseLost
from temper.scheduler.cluster.fencing import fenced
from temper.scheduler.cluster.keeper import LeaseKeeper
from temper.scheduler.db import models as m
from temper.scheduler.db.store import Store, upgrade_schema

CLUSTER = Path(__file__).resolve().parents[2] / "scheduler" / "cluster"
_names = iter(range(10**6))


@pytest.fixture(scope="module")
def store(new_postgres_database):
    url = new_postgres_database("temper_leases")
    upgrade_schema(url)
    store = Store(url)
    yield store
    store.engine.dispose()


@pytest.fixture
def keeper(store):
    return LeaseKeeper(store.sessions, lock_timeout=0.5)


@pytest.fixture
def lane():
    return f"trainer-{next(_names)}:50051"


def tenants(store, prefix: str) -> int:
    with store.sessions() as db:
        return db.scalar(select(func.count()).select_from(m.Tenant).where(m.Tenant.name.like(prefix + "%")))


def fenced_write(store, lease, tenant: str) -> None:
    """A lane's durable write as lanes will make it: fenced first, then the rows, in one transaction."""
    with store.sessions.begin() as db:
        fenced(db, lease)
        db.add(m.Tenant(name=tenant, weight=1.0))


def test_two_owners_contend_and_exactly_one_wins(keeper, lane):
    a = keeper.acquire(lane, "replica-a", 5)
    assert a is not None and (a.lane, a.owner, a.token) == (lane, "replica-a", 1)
    assert keeper.acquire(lane, "replica-b", 5) is None
    assert keeper.acquire(lane, "replica-a", 5) is None, "a live lease is renewed, not taken again"
    assert tuple(keeper.holder(lane)) == ("replica-a", 1, True)
    assert [(x.token, x.ttl) for x in keeper.owned_by("replica-a") if x.lane == lane] == [(1, 5.0)]
    assert lane not in {x.lane for x in keeper.owned_by("replica-b")}


def test_renew_extends_from_the_database_clock(store, keeper, lane):
    lease = keeper.acquire(lane, "replica-a", 2)
    time.sleep(0.2)
    renewed = keeper.renew(lease)
    assert renewed.token == lease.token and renewed.ttl == 2
    assert (renewed.expires_at - lease.expires_at).total_seconds() >= 0.2
    longer = keeper.renew(renewed, ttl=30)
    with store.sessions() as db:
        db_now = db.scalar(text("SELECT clock_timestamp()"))
    assert 29 < (longer.expires_at - db_now).total_seconds() <= 30
    assert [x.ttl for x in keeper.owned_by("replica-a") if x.lane == lane] == [pytest.approx(30)]


def test_an_expired_lease_is_taken_with_the_next_token_and_the_old_owner_is_fenced(store, keeper, lane):
    """The frozen replica: A's lease (1 s) runs out while A sleeps, B takes the lane, A wakes and
    tries to renew and to write: both raise LeaseLost, and A's write leaves nothing."""
    a = keeper.acquire(lane, "replica-a", 1)
    fenced_write(store, a, "lease-a-before")  # while it holds the lane, A writes
    assert keeper.acquire(lane, "replica-b", 1) is None
    time.sleep(1.2)
    b = keeper.acquire(lane, "replica-b", 5)
    assert b is not None and b.token == a.token + 1 and b.owner == "replica-b"
    with pytest.raises(LeaseLost, match="another replica holds it"):
        keeper.renew(a)
    with pytest.raises(LeaseLost, match="token 2 of 'replica-b'"):
        fenced_write(store, a, "lease-a-after")
    assert tenants(store, "lease-a-after") == 0 and tenants(store, "lease-a-before") == 1
    fenced_write(store, b, "lease-b")
    assert tenants(store, "lease-b") == 1
    assert lane not in {x.lane for x in keeper.owned_by("replica-a")}
    assert [x.token for x in keeper.owned_by("replica-b") if x.lane == lane] == [2]


def test_an_expired_lease_nobody_took_writes_nothing_but_may_be_renewed(store, keeper, lane):
    a = keeper.acquire(lane, "replica-a", 0.3)
    time.sleep(0.5)
    with pytest.raises(LeaseLost, match="expired"):
        fenced_write(store, a, "lease-expired")
    assert tenants(store, "lease-expired") == 0
    again = keeper.renew(a, ttl=5)  # no newer token exists, so nobody else wrote: extending is safe
    fenced_write(store, again, "lease-expired-renewed")
    assert tenants(store, "lease-expired-renewed") == 1


def test_release_frees_the_lane_and_the_token_counts_on(store, keeper, lane):
    a = keeper.acquire(lane, "replica-a", 30)
    assert keeper.release(a) is True and keeper.release(a) is False
    with pytest.raises(LeaseLost, match="released"):
        keeper.renew(a)
    with pytest.raises(LeaseLost, match="released"):
        fenced_write(store, a, "lease-released")
    assert tenants(store, "lease-released") == 0
    b = keeper.acquire(lane, "replica-b", 30)
    assert b.token == 2  # the row outlived the release: token 1 is never issued again


def test_a_replica_frozen_inside_its_fenced_transaction_cannot_commit_after_takeover(store, keeper, lane):
    """A passes the check, then freezes holding its transaction open. While it holds the row, B
    cannot take the lane (the lock orders A's write before any newer token); past A's lease
    PostgreSQL ends A's idle transaction, B takes the lane with the next token, and A's commit on
    waking fails: its row was never written."""
    a = keeper.acquire(lane, "replica-a", 1)
    checked, outcome = threading.Event(), {}

    def frozen_replica():
        try:
            with store.sessions.begin() as db:
                fenced(db, a)
                db.add(m.Tenant(name="lease-frozen", weight=1.0))
                db.flush()
                checked.set()
                time.sleep(2.5)  # SIGSTOP: past the 1 s lease with the transaction open
        except Exception as exc:  # noqa: BLE001 - the test asserts which
            outcome["error"] = exc
        checked.set()

    thread = threading.Thread(target=frozen_replica)
    thread.start()
    assert checked.wait(10)
    assert keeper.acquire(lane, "replica-b", 5) is None  # A's transaction holds the lane's row
    deadline, b = time.monotonic() + 8, None
    while b is None and time.monotonic() < deadline:
        b = keeper.acquire(lane, "replica-b", 5)
        time.sleep(0.1)
    assert b is not None and b.token == a.token + 1
    thread.join(10)
    # PostgreSQL ended A's session (idle_in_transaction_session_timeout): its commit finds it gone
    assert isinstance(outcome.get("error"), DBAPIError) and outcome["error"].connection_invalidated, outcome
    assert tenants(store, "lease-frozen") == 0


def test_concurrent_acquires_from_threads_give_one_owner_and_increasing_tokens(keeper, lane):
    threads, rounds = 8, 6
    barrier, lock = threading.Barrier(threads), threading.Lock()
    winners: dict[int, list] = {r: [] for r in range(rounds)}

    def replica(name: str):
        for r in range(rounds):
            barrier.wait()
            lease = keeper.acquire(lane, name, 30)
            if lease is not None:
                with lock:
                    winners[r].append(lease)
            barrier.wait()
            if lease is not None:
                assert keeper.release(lease)

    workers = [threading.Thread(target=replica, args=(f"replica-{i}",)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert [len(winners[r]) for r in range(rounds)] == [1] * rounds
    assert [winners[r][0].token for r in range(rounds)] == list(range(1, rounds + 1))


def test_concurrent_takeover_of_an_expired_lease_has_one_winner(keeper, lane):
    old = keeper.acquire(lane, "replica-old", 0.2)
    time.sleep(0.4)
    barrier, won = threading.Barrier(6), []

    def taker(name):
        barrier.wait()
        if (lease := keeper.acquire(lane, name, 30)) is not None:
            won.append(lease)

    workers = [threading.Thread(target=taker, args=(f"taker-{i}",)) for i in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert len(won) == 1 and won[0].token == old.token + 1


def test_only_the_database_clock_decides(store, keeper, lane, monkeypatch):
    """The replica's clock moved an hour forward (or back) changes nothing: a live lease stays live
    and held, an expired one is still taken. The lease, fencing and directory modules never read a Python clock."""
    a = keeper.acquire(lane, "replica-a", 30)
    real_time, real_monotonic = time.time, time.monotonic
    for shift in (3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda: real_time() + shift)
        monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + shift)
        assert keeper.acquire(lane, "replica-b", 30) is None
        a = keeper.renew(a)
        fenced_write(store, a, f"lease-clock{shift:+.0f}")
    monkeypatch.undo()
    short = keeper.acquire(f"{lane}-short", "replica-a", 0.2)
    time.sleep(0.4)
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
    assert keeper.acquire(f"{lane}-short", "replica-b", 30).token == short.token + 1
    # the lease and fencing modules read no Python clock; ownership.py paces its rounds and hints holds()
    # with the monotonic clock, and never decides a lease by it (test_lane_ownership.py)
    sources = "\n".join((CLUSTER / name).read_text() for name in ("keeper.py", "fencing.py", "lease.py", "directory.py"))
    for reader in ("time.time", "monotonic", "datetime.now", "utcnow", "now()"):
        assert reader not in sources, reader


def test_bad_arguments_are_refused(keeper, lane):
    for args in (("", "a", 1), (lane, "", 1), (lane, "a", 0), (lane, "a", float("nan")), (lane, "a", -1)):
        with pytest.raises(InvalidArgument):
            keeper.acquire(*args)
    assert keeper.holder(lane) is None


def test_sqlite_is_refused(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    with pytest.raises(InvalidArgument, match="PostgreSQL"):
        LeaseKeeper(store.sessions)
    store.engine.dispose()


def test_lease_lost_is_unavailable_but_not_retried_in_process():
    """Clients retry UNAVAILABLE (through any replica: the lane's new owner answers from the log);
    no in-process loop that retries Unavailable resends it here."""
    import grpc

    from temper.common.errors import Unavailable

    exc = LeaseLost("trainer:1", 3, "expired")
    assert exc.code == grpc.StatusCode.UNAVAILABLE and not isinstance(exc, Unavailable)
    assert "trainer:1" in exc.message and "token 3" in exc.message
