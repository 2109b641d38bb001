"""CopyCheckpoint's steps (scheduler/api/billing_copy_verbs.py) and GetBillingUsage's sums
(scheduler/db/billing.py) on a real SQLite store with a fake trainer: a copy adds its closed session,
run, checkpoint and audit entry together; a refusal changes nothing and calls no trainer; a failed
row write removes the files made. The hourly sums equal a direct sum of the rows, the caller's only."""

import asyncio
import shutil
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select

from fakes_scheduler import VerbAdmission
from temper.common.billing import HOUR_MS
from temper.common.errors import InvalidArgument, NotFound, Unavailable
from temper.scheduler.api.billing_copy_verbs import BillingCopyVerbs
from temper.scheduler.db import models as m
from temper.scheduler.db.audit import AuditQuery
from temper.scheduler.db.billing import BillingReader
from temper.scheduler.db.copies import CopyRecords
from temper.scheduler.db.records import SamplingRow
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.v1 import service_pb2, trainer_pb2

T0 = 1_765_000_800_000 - 1_765_000_800_000 % HOUR_MS


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """One migrated database file, copied for each test (migrating takes seconds)."""
    path = tmp_path_factory.mktemp("billing-copy") / "template.db"
    upgrade_schema(f"sqlite:///{path}")
    return path


@pytest.fixture
def store(migrated, tmp_path):
    shutil.copy(migrated, tmp_path / "temper.db")
    return Store(f"sqlite:///{tmp_path / 'temper.db'}")


class Trainer:
    address = "trainer:1"

    def __init__(self):
        self.calls = []

    async def call(self, method, request):
        self.calls.append((method, request.checkpoint_key))
        return trainer_pb2.CopyCheckpointFilesResponse(size_bytes=42) if method == "CopyCheckpoint" else None


class Backends:
    def __init__(self, trainer):
        self.trainer, self.placed = trainer, {}

    async def wait_ready(self):
        return None

    def trainer_for(self, base_model, run_id):
        return self.trainer

    def remember_placement(self, run_id, address):
        self.placed[run_id] = address


class Verbs(BillingCopyVerbs):
    def __init__(self, store):
        self.store, self.backends, self.admission = store, Backends(Trainer()), VerbAdmission()


def add_run(store, tenant, model="tiny", index=0):
    session = store.create_session(tenant, [], {})
    run = m.TrainingRun(id=f"{session.id}:train:{index}", session_id=session.id, base_model=model, lora_rank=4, lora_alpha=8.0,
                        train_attn=True, train_mlp=True, train_unembed=False, user_metadata={})
    store.add_training_run(run)
    return session.id, run.id


def call(verb, tenant, request):
    async def run():
        token = set_caller(tenant)
        try:
            return await verb(request, None)
        finally:
            reset_caller(token)

    return asyncio.run(run())


def counts(store):
    with store.sessions() as db:
        return tuple(db.scalar(select(func.count()).select_from(t)) for t in (m.Session, m.TrainingRun, m.Checkpoint, m.AuditEntry))


def test_a_copy_adds_its_rows_together_and_refusals_change_nothing(store):
    _, run_id = add_run(store, "alice")
    path = f"tinker://{run_id}/weights/w1"
    store.add_checkpoint(run_id, "training", "w1", path, 42)
    bob_project = store.create_project("bob", "theirs").id
    verbs = Verbs(store)
    before = counts(store)
    for tenant, request, error in [
            ("bob", service_pb2.CopyCheckpointRequest(source_path=path), NotFound),  # not published
            ("alice", service_pb2.CopyCheckpointRequest(source_path=path, project_id=bob_project), NotFound),
            ("alice", service_pb2.CopyCheckpointRequest(source_path=path.replace("w1", "nope")), NotFound),
            ("alice", service_pb2.CopyCheckpointRequest(source_path="tinker://x"), InvalidArgument),
            ("alice", service_pb2.CopyCheckpointRequest(source_path=path, ttl_seconds=60), InvalidArgument)]:
        with pytest.raises(error):
            call(verbs.CopyCheckpoint, tenant, request)
    assert counts(store) == before and verbs.backends.trainer.calls == []

    copied = call(verbs.CopyCheckpoint, "alice", service_pb2.CopyCheckpointRequest(source_path=path, ttl_seconds=7200))
    assert counts(store) == tuple(n + 1 for n in before)
    new_run = copied.training_run_id
    assert copied.path == f"tinker://{new_run}/weights/w1" and copied.size_bytes == 42
    assert verbs.backends.trainer.calls == [("CopyCheckpoint", f"{new_run}/weights/w1")]
    assert store.session_closed(new_run.split(":train:")[0]) and store.run_owner(new_run) == "alice"
    assert 7100 < copied.expires_unix_ms / 1000 - datetime.now(timezone.utc).timestamp() < 7300
    entry = store.audit_entries(AuditQuery(tenant="alice", action="checkpoint.copy"))[0][0]
    assert entry.target == copied.path and entry.details["source"] == path


def test_a_failed_row_write_removes_the_copied_files(store, monkeypatch):
    _, run_id = add_run(store, "alice")
    path = f"tinker://{run_id}/sampler_weights/s1"
    store.add_checkpoint(run_id, "sampler", "s1", path, 42)
    verbs, before = Verbs(store), counts(store)

    def fail(*args, **kwargs):
        raise Unavailable("the database did not answer")

    monkeypatch.setattr(CopyRecords, "add_copied_checkpoint", fail)
    with pytest.raises(Unavailable):
        call(verbs.CopyCheckpoint, "alice", service_pb2.CopyCheckpointRequest(source_path=path))
    (copy_call, key), (delete_call, deleted) = verbs.backends.trainer.calls
    assert (copy_call, delete_call) == ("CopyCheckpoint", "DeleteCheckpoint") and deleted == key
    assert counts(store) == before


def test_billing_sums_equal_a_direct_sum_of_the_callers_rows(store):
    sessions = {tenant: add_run(store, tenant, model) for tenant, model in (("alice", "m1"), ("bob", "m2"))}
    metric = dict(step=1, status="done", error=None, loss=None, grad_norm=None, learning_rate=None, metrics={},
                  queued_seconds=0, trainer_seconds=0, cobatched_with=0, trainer="t", cycle=1, created_ms=0, started_ms=0)
    rows = []  # (tenant, run, seq, kind, tokens, answered)
    for i, (tenant, kind, tokens, at) in enumerate([("alice", "forward_backward", 10, T0 + 5), ("alice", "forward_backward", 7, T0 + 99),
                                                     ("alice", "forward_backward", 3, T0 + HOUR_MS + 1), ("alice", "forward", 50, T0),
                                                     ("alice", "forward_backward", 9, T0 - 1), ("bob", "forward_backward", 11, T0)]):
        rows.append(dict(training_run_id=sessions[tenant][1], seq_id=i + 1, kind=kind, num_tokens=tokens, answered_ms=at, **metric))
    with store.engine.begin() as conn:
        conn.execute(m.RunMetric.__table__.insert(), rows)
    sampler = m.SamplingClient(id=f"{sessions['alice'][0]}:sample:0", session_id=sessions["alice"][0], base_model="m1")
    with store.sessions.begin() as db:
        db.add(sampler)
    store.record_sampling([SamplingRow(sessions["alice"][0], sampler.id, "sample", 1, 6, 4, T0 + 10, T0 + 20),
                           SamplingRow(sessions["alice"][0], sampler.id, "compute_logprobs", 0, 8, 0, T0 + 30, T0 + 40),
                           SamplingRow(sessions["bob"][0], "other", "sample", 1, 100, 100, T0 + 10, T0 + 20)])
    usage = BillingReader(store).billing_usage("alice", T0, T0 + 2 * HOUR_MS, T0 + 2 * HOUR_MS)
    tokens = {(u.hour_ms, u.kind): u.token_count for u in usage if u.token_count}
    alice_session = sessions["alice"][0]
    assert {(u.base_model, u.session_id) for u in usage if u.token_count} == {("m1", alice_session)}
    assert tokens == {(T0, "training"): 17, (T0 + HOUR_MS, "training"): 3, (T0, "sampling_prefill"): 14,
                      (T0, "sampling_sample"): 4}
    assert [u for u in BillingReader(store).billing_usage("carol", T0, T0 + HOUR_MS, T0 + HOUR_MS)] == []


def test_storage_is_the_callers_checkpoints_bytes_over_their_life(store):
    _, run_id = add_run(store, "alice", "m1")
    _, bob_run = add_run(store, "bob", "m1")
    created = datetime.fromtimestamp(T0 / 1000 + 1800, tz=timezone.utc)  # half way through the first hour
    with store.sessions.begin() as db:
        db.add(m.Checkpoint(training_run_id=run_id, kind="sampler", name="s", path=f"tinker://{run_id}/sampler_weights/s",
                            size_bytes=2_000_000_000, created_at=created, expires_at=created + timedelta(hours=1)))
        db.add(m.Checkpoint(training_run_id=bob_run, kind="sampler", name="s", path=f"tinker://{bob_run}/sampler_weights/s",
                            size_bytes=9_000_000_000, created_at=created))
    usage = BillingReader(store).billing_usage("alice", T0, T0 + 3 * HOUR_MS, T0 + 3 * HOUR_MS)
    storage = {u.hour_ms: u.gigabyte_hours for u in usage if u.kind == "storage"}
    assert storage == {T0: pytest.approx(1.0), T0 + HOUR_MS: pytest.approx(1.0)}  # 2 GB for half of each hour
    assert [(u.hour_ms, u.count) for u in usage if u.kind == "checkpoint"] == [(T0, 1)]


def test_trainer_store_copy_links_files_and_outlives_the_source(tmp_path):
    from temper.common.errors import AlreadyExists
    from temper.services.trainer.checkpoints import CheckpointStore

    files = CheckpointStore(tmp_path / "ckpt")
    staging = files.staging_dir("r/weights/a")
    (staging / "adapter_model.safetensors").write_bytes(b"w" * 100)
    (staging / "optimizer.pt").write_bytes(b"o" * 20)
    files.publish(staging, "r/weights/a")
    assert files.copy("r/weights/a", "c/weights/a") == 120
    source, copy = files.path("r/weights/a") / "optimizer.pt", files.path("c/weights/a") / "optimizer.pt"
    assert copy.stat().st_ino == source.stat().st_ino  # linked, not duplicated
    with pytest.raises(AlreadyExists):
        files.copy("r/weights/a", "c/weights/a")
    with pytest.raises(NotFound):
        files.copy("r/weights/none", "d/weights/a")
    assert not (tmp_path / "ckpt" / "d").exists()
    files.delete("r/weights/a")
    assert sorted(p.name for p in files.path("c/weights/a").iterdir()) == ["adapter_model.safetensors", "optimizer.pt"]
    assert copy.read_bytes() == b"o" * 20
