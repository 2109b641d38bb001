"""The tenancy store paths on SQLite (the default of `make demo` and LocalStack), which hands back
naive datetimes: key lookups after a key's first use, TTL expiry and snapshot collection."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from temper.common.errors import NotFound, Unauthenticated
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import now
from temper.scheduler.db.store import Store, upgrade_schema


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'temper.db'}"
    upgrade_schema(url)
    yield Store(url)


def run_of(store: Store, tenant: str) -> str:
    session = store.create_session(tenant, [], {})
    run_id = store.next_run_id(session.id)
    store.add_training_run(m.TrainingRun(id=run_id, session_id=session.id, base_model="b", lora_rank=4, lora_alpha=8.0,
                                         train_attn=True, train_mlp=True, train_unembed=False))
    return run_id


def test_a_used_key_is_looked_up_again_and_a_revoked_one_refused(store):
    key, row = store.create_api_key("alice")
    assert store.tenant_for_key(key) == "alice"
    with store.sessions.begin() as db:  # its last use a while ago: the lookup records a new one
        db.execute(update(m.ApiKey).where(m.ApiKey.id == row.id).values(last_used_at=now() - timedelta(minutes=5)))
    assert store.tenant_for_key(key) == "alice"
    store.revoke_api_key(row.prefix)
    with pytest.raises(Unauthenticated, match="revoked"):
        store.tenant_for_key(key)


def test_expired_checkpoints_and_idle_snapshots_are_collectable_and_unreadable(store):
    run_id = run_of(store, "alice")
    expiring = store.add_checkpoint(run_id, "sampler", "e", f"tinker://{run_id}/sampler_weights/e", 10, ttl_seconds=1)
    old = store.add_checkpoint(run_id, "sampler", "s1", f"tinker://{run_id}/sampler_weights/s1", 10, ephemeral=True)
    newest = store.add_checkpoint(run_id, "sampler", "s2", f"tinker://{run_id}/sampler_weights/s2", 10, ephemeral=True)
    assert store.collectable_checkpoints(timedelta(seconds=60)) == []
    with store.sessions.begin() as db:
        db.execute(update(m.Checkpoint).values(created_at=now() - timedelta(minutes=5)))
        db.execute(update(m.Checkpoint).where(m.Checkpoint.id == expiring.id).values(expires_at=now() - timedelta(seconds=1)))
    assert sorted(c.id for c in store.collectable_checkpoints(timedelta(seconds=60))) == [expiring.id, old.id]  # newest stays
    with pytest.raises(NotFound):
        store.readable_checkpoint(expiring.path, "alice")
    assert store.readable_checkpoint(newest.path, "alice").id == newest.id
    assert [c.name for c in store.tenant_checkpoints("alice")] == ["e"]  # snapshots are unlisted
    with pytest.raises(NotFound):
        store.readable_checkpoint(newest.path, "bob")
