"""The audit log in real PostgreSQL (migrated to head): each audited change leaves exactly one entry
naming who and what, written in the change's own transaction (no entry: no change); a refused change
leaves none; a tenant's query sees only its own entries; and the log is append-only — no code path
updates or deletes an entry, and the database refuses UPDATE, DELETE and TRUNCATE."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound
from temper.scheduler.db import audit, models as m, tenancy
from temper.scheduler.db.audit import Actor, AuditQuery
from temper.scheduler.db.outage import now
from temper.scheduler.db.store import Store, upgrade_schema

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"


@pytest.fixture(scope="module")
def store(new_postgres_database):
    url = new_postgres_database("temper_audit")
    upgrade_schema(url)
    store = Store(url)
    yield store
    store.engine.dispose()


def entries(store: Store, tenant: str | None, **kwargs) -> list[m.AuditEntry]:
    return store.audit_entries(AuditQuery(tenant=tenant, limit=1000, **kwargs))[0]


def checkpoint_of(store: Store, tenant: str, name: str) -> str:
    session = store.create_session(tenant, [], {}, Actor.api("tml-setup000", tenant)).id
    run = m.TrainingRun(id=f"{session}:train:0", session_id=session, base_model="b", lora_rank=4, lora_alpha=8.0,
                        train_attn=True, train_mlp=True, train_unembed=False)
    path = f"tinker://{run.id}/sampler_weights/{name}"
    store.add_imported_run(run, [m.Checkpoint(training_run_id=run.id, kind="sampler", name=name, path=path, size_bytes=46)],
                           tenant, Actor.api("tml-setup000", tenant))
    return path


def test_each_change_leaves_one_entry_naming_who_and_what(store):
    alice = Actor.api("tml-aliceKEY", "carol")
    newest = lambda: entries(store, "carol")[0]  # noqa: E731

    key, row = store.create_api_key("carol", "laptop", False, alice)
    assert (newest().action, newest().target, newest().key_prefix, newest().actor) == ("api_key.create", row.prefix,
                                                                                       "tml-aliceKEY", "api")
    assert newest().details == {"key_id": str(row.id), "label": "laptop", "is_admin": "false"}
    store.revoke_api_key(row.prefix, "carol", alice)
    assert (newest().action, newest().target) == ("api_key.revoke", row.prefix)
    count = len(entries(store, "carol"))
    store.revoke_api_key(row.prefix, "carol", alice)  # already revoked: nothing changes, nothing is logged
    assert len(entries(store, "carol")) == count

    store.set_limits("carol", {"max_training_runs": 4, "train_tokens_per_minute": None}, Actor.admin_command())
    assert (newest().action, newest().actor, newest().key_prefix, newest().target) == ("quota.set", "admin-command", "", "carol")
    assert newest().details == {"max_training_runs": "4", "train_tokens_per_minute": "default"}

    session = store.create_session("carol", [], {}, alice)
    assert (newest().action, newest().target) == ("session.open", session.id)
    store.close_session(session.id, "success", "carol", alice)
    assert (newest().action, newest().target, newest().details) == ("session.close", session.id, {"status": "success"})

    path = checkpoint_of(store, "carol", "w")
    assert (newest().action, newest().target, newest().details["size_bytes"]) == ("checkpoint.import", path, "46")
    before = len(entries(store, "carol"))
    store.update_checkpoint(path, "carol", True, False, alice)
    assert (newest().action, newest().target) == ("checkpoint.publish", path)
    store.update_checkpoint(path, "carol", False, False, alice)
    assert newest().action == "checkpoint.unpublish"
    store.update_checkpoint(path, "carol", None, now() + timedelta(hours=1), alice, 3600)
    assert (newest().action, newest().details["ttl_seconds"]) == ("checkpoint.ttl", "3600")
    store.delete_checkpoint_row(store.get_checkpoint(path).id, alice)
    assert (newest().action, newest().target, newest().details) == ("checkpoint.delete", path, {"size_bytes": "46"})
    assert len(entries(store, "carol")) == before + 4  # exactly one entry each


def test_a_repeated_change_is_logged_once(store):
    """A save resent after its answer was lost, a publish of a published checkpoint, clearing a TTL
    that is not set: each leaves the one entry of the change it repeats (or none)."""
    jo = Actor.api("tml-joKEY000", "jo")
    path = checkpoint_of(store, "jo", "imported")
    run_id = store.get_checkpoint(path).training_run_id
    saved = f"tinker://{run_id}/sampler_weights/w"
    count = len(entries(store, "jo"))
    for _ in range(2):  # the second: the loop's retry of the same save (the row is there already)
        store.add_or_get_checkpoint(run_id, "sampler", "w", saved, 46, False, 0, {}, jo)
    snapshot = f"tinker://{run_id}/sampler_weights/ephemeral-3"
    store.add_or_get_checkpoint(run_id, "sampler", "ephemeral-3", snapshot, 46, True, 0, {}, jo)
    for _ in range(2):
        store.update_checkpoint(saved, "jo", True, False, jo)
    store.update_checkpoint(saved, "jo", None, None, jo, 0)  # no TTL to clear
    store.update_checkpoint(saved, "jo", None, now() + timedelta(hours=1), jo, 3600)
    store.update_checkpoint(saved, "jo", None, None, jo, 0)
    store.update_checkpoint(saved, "jo", None, None, jo, 0)
    new = [(e.action, e.target, e.details.get("temporary"), e.key_prefix) for e in reversed(entries(store, "jo")[:-count])]
    assert new == [("checkpoint.save", saved, None, "tml-joKEY000"), ("checkpoint.save", snapshot, "true", "tml-joKEY000"),
                   ("checkpoint.publish", saved, None, "tml-joKEY000"), ("checkpoint.ttl", saved, None, "tml-joKEY000"),
                   ("checkpoint.ttl", saved, None, "tml-joKEY000")]
    assert store.get_checkpoint(saved).published and store.get_checkpoint(saved).expires_at is None
    # listings: a temporary checkpoint only when asked for
    assert [c.path for c in store.list_checkpoints(run_id)] == [path, saved]
    assert [c.path for c in store.tenant_checkpoints("jo", include_temporary=True)] == [path, saved, snapshot]


def test_a_refused_change_leaves_no_entry(store):
    path = checkpoint_of(store, "dave", "mine")
    _, erins_key = store.create_api_key("erin", "", False, Actor.api("tml-erinKEY0", "erin"))
    session = store.create_session("dave", [], {}, Actor.api("tml-daveKEY0", "dave"))
    store.close_session(session.id, "success", "dave")
    counts = {t: len(entries(store, t)) for t in ("dave", "erin")}
    thief = Actor.api("tml-erinKEY0", "erin")
    with pytest.raises(NotFound):
        store.update_checkpoint(path, "erin", True, False, thief)  # another tenant's checkpoint
    with pytest.raises(NotFound):
        store.revoke_api_key(erins_key.prefix, "dave", Actor.api("tml-daveKEY0", "dave"))  # another tenant's key
    with pytest.raises(NotFound):
        store.revoke_api_key("99999999999999", "dave")  # past api_keys.id's range: not found, not a database error
    with pytest.raises(InvalidArgument):
        store.set_limits("dave", {"max_gpus": 1})
    with pytest.raises(FailedPrecondition):
        store.close_session(session.id, "success", "dave")  # closed already
    with pytest.raises(NotFound):
        store.close_session(session.id, "success", "erin")
    assert {t: len(entries(store, t)) for t in ("dave", "erin")} == counts
    assert not store.get_checkpoint(path).published


def test_no_entry_no_change(store, monkeypatch):
    """The entry is written in the change's transaction: when writing it fails, the change is undone."""
    path = checkpoint_of(store, "fay", "w")
    count = len(entries(store, "fay"))

    def failing(*args, **kwargs):
        raise RuntimeError("the audit entry could not be written")

    monkeypatch.setattr(tenancy, "record", failing)
    with pytest.raises(RuntimeError):
        store.update_checkpoint(path, "fay", True, False, Actor.api("tml-fayKEY00", "fay"))
    with pytest.raises(RuntimeError):
        store.create_api_key("fay", "x")
    monkeypatch.undo()
    assert not store.get_checkpoint(path).published
    assert store.list_api_keys("fay") == [] and len(entries(store, "fay")) == count


def test_queries_keep_tenants_apart_and_page_newest_first(store):
    for tenant in ("gus", "hana"):
        for _ in range(3):
            store.create_session(tenant, [], {}, Actor.api(f"tml-{tenant}KEY", tenant))
    gus = entries(store, "gus")
    assert len(gus) == 3 and {e.tenant for e in gus} == {"gus"} and [e.id for e in gus] == sorted((e.id for e in gus), reverse=True)
    everyone = {e.tenant for e in entries(store, None)}
    assert {"gus", "hana"} <= everyone
    first, more = store.audit_entries(AuditQuery(tenant="gus", limit=2))
    rest, done = store.audit_entries(AuditQuery(tenant="gus", limit=2, before_id=first[-1].id))
    assert more and not done and [e.id for e in first + rest] == [e.id for e in gus]
    assert entries(store, "gus", action="session.close") == []
    assert entries(store, "gus", since=gus[0].at + timedelta(seconds=1)) == []
    with pytest.raises(InvalidArgument):
        store.audit_entries(AuditQuery(tenant="gus", limit=1001))
    with pytest.raises(InvalidArgument):
        store.audit_entries(AuditQuery(tenant="gus", action="drop_table"))


def test_the_database_refuses_to_change_or_remove_an_entry(store):
    store.create_session("ivy", [], {}, Actor.api("tml-ivyKEY00", "ivy"))
    engine = create_engine(store.engine.url)
    try:
        for statement in ("UPDATE audit_log SET tenant = 'mallory'", "DELETE FROM audit_log", "TRUNCATE audit_log"):
            with pytest.raises(DBAPIError, match="audit_log is append-only"):
                with engine.begin() as conn:
                    conn.execute(text(statement))
    finally:
        engine.dispose()
    assert [e.tenant for e in entries(store, "ivy")] == ["ivy"]


def test_no_code_path_updates_or_deletes_an_entry():
    """Only the model, the writer (audit.py: an insert) and the API's reader mention AuditEntry, and
    nothing in the scheduler names the table in an UPDATE or DELETE."""
    mentions = sorted(str(p.relative_to(SCHEDULER)) for p in SCHEDULER.rglob("*.py") if "AuditEntry" in p.read_text())
    assert mentions == ["api/audit_verbs.py", "db/audit.py", "db/models.py"]
    source = (SCHEDULER / "db" / "audit.py").read_text()
    assert not re.search(r"\b(update|delete)\(", source) and "db.delete" not in source
    for path in SCHEDULER.rglob("*.py"):
        assert not re.search(r"(?i)(update|delete\s+from)\s+audit_log", path.read_text()), path
    assert not [n for n in dir(audit.AuditStore) if re.match(r"(update|delete|remove|prune)", n)]
