"""Projects, session search and expiry in the store, on SQLite without a stack (issue 33;
scheduler/db/projects.py, session_search.py). The same calls through the SDK on PostgreSQL:
tests/stack/test_sdk_sessions_projects.py."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import update

from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.audit import AuditQuery
from temper.scheduler.db.outage import now
from temper.scheduler.db.records import SamplingRow
from temper.scheduler.db.views import unix_ms
from temper.scheduler.db.session_search import SessionQuery
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.planning.session_expiry import SessionExpiry, sweep_interval


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'temper.db'}"
    upgrade_schema(url)
    yield Store(url)


def ids(hits):
    return [h.row.id for h in hits]


def test_projects_belong_to_one_tenant(store):
    nightly = store.create_project("alice", "nightly")
    with pytest.raises(AlreadyExists):
        store.create_project("alice", "nightly")
    assert store.create_project("bob", "nightly").id != nightly.id  # names are per tenant
    for bad in ("", "   ", "tab\there", "x" * 257):
        with pytest.raises(InvalidArgument):
            store.create_project("alice", bad)
    assert [p.name for p in store.tenant_projects("alice")] == ["nightly"]
    mine = store.create_session("alice", [], {}, display_name="first", project_id=nightly.id)
    assert (mine.display_name, mine.project_id) == ("first", nightly.id)
    with pytest.raises(NotFound):  # another tenant's project: as a missing one, and no session made
        store.create_session("bob", [], {}, project_id=nightly.id)
    assert store.tenant_sessions("bob", 10, 0) == ([], 0)
    bobs = store.create_session("bob", [], {}).id
    with pytest.raises(NotFound):  # assigning another tenant's session: nothing changes
        store.assign_session_project(bobs, nightly.id, "alice")
    loose = store.create_session("alice", [], {}).id
    with pytest.raises(NotFound):
        store.assign_session_project(loose, store.tenant_projects("bob")[0].id, "alice")
    with pytest.raises(NotFound):
        store.assign_session_project(loose, "proj-missing", "alice")
    assert store.session_detail(loose, "alice").row.project_id is None
    store.assign_session_project(loose, nightly.id, "alice")
    assert store.tenant_sessions("alice", 10, 0, nightly.id)[1] == 2
    actions = [e.action for e in store.audit_entries(AuditQuery(tenant="alice", limit=50))[0]]
    assert actions.count("project.create") == 1 and actions.count("session.project") == 1


def test_search_filters_and_pages(store):
    proj = store.create_project("alice", "p").id
    made = []
    for i, (name, meta) in enumerate([("Nightly SFT run", {"team": "rl"}), ("nightly eval", {"team": "rl"}),
                                      ("100%_done", {"team": "sft"}), (None, {})]):
        row = store.create_session("alice", [], meta, display_name=name or "", project_id=proj if i < 2 else "")
        made.append(row.id)
    store.create_session("bob", [], {"team": "rl"}, display_name="nightly")  # never in alice's results
    store.close_session(made[1], "errored", "alice")

    def search(**q):
        return ids(store.search_sessions("alice", SessionQuery(**q))[0])

    assert search() == made[::-1]
    assert search(words=("nightly",)) == [made[1], made[0]]
    assert search(words=("sft", "nightly")) == [made[0]]
    assert search(words=("100%_",)) == [made[2]] and search(words=("0%x",)) == []  # % and _ are literal
    assert search(user_metadata={"team": "rl"}) == [made[1], made[0]]
    assert search(project_ids=(proj,), statuses=("open",)) == [made[0]]
    assert search(statuses=("errored", "expired")) == [made[1]]
    assert search(session_id=made[3], words=("eval",)) == [made[3], made[1]]  # either one matches
    page, more = store.search_sessions("alice", SessionQuery(limit=3))
    assert more and ids(page) == made[:0:-1]
    last = page[-1].row
    rest, more = store.search_sessions("alice", SessionQuery(limit=3, after=(last.created_at, last.id)))
    assert not more and ids(rest) == [made[0]]


def test_expiry_closes_silent_idle_sessions_once_and_releases_them(store):
    silent = store.create_session("alice", [], {}).id
    alive = store.create_session("alice", [], {}).id
    closed = store.create_session("alice", [], {}).id
    training, sampling = store.create_session("alice", [], {}).id, store.create_session("alice", [], {}).id
    store.close_session(closed, "success", "alice")
    long_ago = now() - timedelta(seconds=60)
    with store.sessions.begin() as db:
        db.execute(update(m.Session).where(m.Session.id.in_([silent, closed, training, sampling])).values(last_heartbeat_at=long_ago))
        # no heartbeats, but working: a request of its run recorded now, or a sample answered now
        db.add(m.TrainingRun(id=f"{training}:train:0", session_id=training, base_model="b", lora_rank=4, lora_alpha=8.0,
                             train_attn=True, train_mlp=True, train_unembed=True, last_request_at=now()))
    store.record_sampling([SamplingRow(sampling, f"{sampling}:sample:0", "sample", 1, 3, 2, unix_ms(now()), unix_ms(now()))])
    released = []
    expiry = SessionExpiry(store, released.append, expire_seconds=30)
    assert asyncio.run(expiry.sweep_once()) == []  # not yet 30 s in touch with the database: heartbeats may be missing
    expiry.healthy_since -= 30
    assert asyncio.run(expiry.sweep_once()) == [silent]
    assert asyncio.run(expiry.sweep_once()) == []  # a second sweep (or replica) expires nothing again
    assert released == [silent, silent]  # released again from expired_since: harmless, and how other replicas learn
    row = store.session_detail(silent, "alice").row
    assert row.close_status == "expired" and store.session_detail(alive, "alice").row.closed_at is None
    assert store.session_detail(closed, "alice").row.close_status == "success"
    assert all(store.session_detail(s, "alice").row.closed_at is None for s in (training, sampling))
    with pytest.raises(FailedPrecondition, match="expired"):
        store.heartbeat(silent, "alice")
    expiries = [e for e in store.audit_entries(AuditQuery(tenant="alice", limit=50))[0] if e.action == "session.expire"]
    assert [(e.target, e.actor) for e in expiries] == [(silent, "scheduler")]
    assert sweep_interval(600) == 30 and sweep_interval(3) == 1 and sweep_interval(600, 2.5) == 2.5
