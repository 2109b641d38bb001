"""In-flight targets (docs/async_rl.md) below the network: the store's one-transaction save and move
(monotonic, a resent save gets its own version again), collection that never takes a run's current
target, the scheduler's in-memory copy (never backwards, read from the database on a miss), the
spans filled for a sampler that reports none, and the checks of an in-flight save."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

from temper.common.errors import AlreadyExists, InvalidArgument, NotFound
from temper.common.codec import encode_tokens
from temper.scheduler.api.inflight_verbs import PieceSpans, check_inflight_save, fill_spans
from temper.scheduler.db import models as m
from temper.scheduler.db.outage import now
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.db.views import run_message
from temper.scheduler.planning.inflight import InflightTargets, Target
from temper.v1 import service_pb2, types_pb2


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'temper.db'}"
    upgrade_schema(url)
    yield Store(url)


def run_of(store: Store, tenant: str = "alice") -> str:
    session = store.create_session(tenant, [], {})
    run_id = store.next_run_id(session.id)
    store.add_training_run(m.TrainingRun(id=run_id, session_id=session.id, base_model="b", lora_rank=4, lora_alpha=8.0,
                                         train_attn=True, train_mlp=True, train_unembed=False))
    return run_id


def save(store: Store, run_id: str, name: str) -> m.Checkpoint:
    return store.add_inflight_checkpoint(run_id, name, f"tinker://{run_id}/sampler_weights/{name}", 10, {"k": "v"})


def test_each_save_is_the_next_version_in_one_transaction_and_a_resend_gets_the_same(store):
    run_id = run_of(store)
    assert store.inflight_target(run_id) == (0, "")
    assert run_message(store.get_training_run(run_id), "alice", 1, None).inflight == types_pb2.WeightsVersion()
    first, second = save(store, run_id, "inflight-1"), save(store, run_id, "inflight-2")
    assert (first.inflight_version, second.inflight_version) == (1, 2)
    assert first.ephemeral and first.kind == "sampler" and first.user_metadata == {"k": "v"}
    assert store.inflight_target(run_id) == (2, second.path)
    again = save(store, run_id, "inflight-1")  # resent (its answer was lost): the same row, no move
    assert (again.id, again.inflight_version) == (first.id, 1)
    assert store.inflight_target(run_id) == (2, second.path)
    assert run_message(store.get_training_run(run_id), "alice", 1, None).inflight == types_pb2.WeightsVersion(path=second.path, version=2)
    assert store.list_checkpoints(run_id) == []  # unlisted, as snapshots
    store.add_checkpoint(run_id, "sampler", "named", f"tinker://{run_id}/sampler_weights/named", 10)
    with pytest.raises(AlreadyExists):  # a taken name that is not an in-flight version: nothing moves
        save(store, run_id, "named")
    assert store.inflight_target(run_id) == (2, second.path)
    with pytest.raises(NotFound):
        save(store, "no-such-run", "inflight-1")
    with pytest.raises(NotFound):
        store.inflight_target("no-such-run")


def test_concurrent_saves_get_distinct_versions(store):
    run_id = run_of(store)
    versions, errors = [], []

    def one(i: int) -> None:
        try:
            versions.append(save(store, run_id, f"inflight-{i}").inflight_version)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(versions) == list(range(1, 9))
    assert store.inflight_target(run_id).version == 8


def test_collection_keeps_the_current_target_and_takes_idle_earlier_versions(store):
    run_id = run_of(store)
    v1, v2 = save(store, run_id, "inflight-1"), save(store, run_id, "inflight-2")
    snapshot = store.add_checkpoint(run_id, "sampler", "snap", f"tinker://{run_id}/sampler_weights/snap", 10, ephemeral=True)
    assert store.collectable_checkpoints(timedelta(seconds=60)) == []  # all used (made) just now
    with store.sessions.begin() as db:
        db.execute(update(m.Checkpoint).values(created_at=now() - timedelta(minutes=5)))
    # v1 idle: collected; v2 is the target (also once idle); the snapshot is the run's newest snapshot
    assert [c.id for c in store.collectable_checkpoints(timedelta(seconds=60))] == [v1.id]
    store.touch_checkpoint(v1.path)  # a span named it and a client scored with it: kept for idle after that use
    assert store.collectable_checkpoints(timedelta(seconds=60)) == []
    with store.sessions.begin() as db:  # even a target past an expiry is kept while it is the target
        db.execute(update(m.Checkpoint).where(m.Checkpoint.id == v2.id).values(expires_at=now() - timedelta(seconds=1)))
    assert v2.id not in [c.id for c in store.collectable_checkpoints(timedelta(seconds=60))]
    v3 = save(store, run_id, "inflight-3")  # v2 stops being the target: collectable now
    assert v2.id in [c.id for c in store.collectable_checkpoints(timedelta(seconds=60))]
    assert v3.id not in [c.id for c in store.collectable_checkpoints(timedelta(seconds=60))]
    assert snapshot.id not in [c.id for c in store.collectable_checkpoints(timedelta(seconds=60))]


def test_sampling_client_rows_keep_the_run_and_min_version(store):
    run_id = run_of(store)
    session = store.get_training_run(run_id).session_id
    row = store.add_sampling_client(session, "b", None, False, run_id, 3)
    got, tenant, closed = store.get_sampling_client(row.id, "alice")
    assert (got.inflight_run_id, got.min_version, got.model_path, tenant, closed) == (run_id, 3, None, "alice", False)
    plain = store.add_sampling_client(session, "b", None)
    assert (plain.inflight_run_id, plain.min_version) == (None, None)


def test_the_in_memory_target_never_goes_back_and_is_read_on_a_miss(store):
    run_id = run_of(store)
    targets = InflightTargets(store)
    assert asyncio.run(targets.current(run_id)) is None
    v1, v2 = save(store, run_id, "inflight-1"), save(store, run_id, "inflight-2")
    assert asyncio.run(targets.current(run_id)) == Target(run_id, 2, v2.path)  # a miss: from the database
    assert targets.advance(Target(run_id, 1, v1.path)) == Target(run_id, 2, v2.path)  # a late, older one: ignored
    assert targets.known(run_id).version == 2
    assert targets.advance(Target(run_id, 3, "tinker://r/sampler_weights/x")).version == 3
    assert Target(run_id, 2, v2.path).key == f"{run_id}/sampler_weights/inflight-2"
    assert Target(run_id, 2, v2.path).weights() == types_pb2.WeightsVersion(path=v2.path, version=2)


def test_spans_are_filled_from_what_was_sent_only_where_the_sampler_gave_none():
    sent = types_pb2.WeightsVersion(path="tinker://r/sampler_weights/a", version=4)
    other = types_pb2.WeightsVersion(path="tinker://r/sampler_weights/b", version=5)
    bare = types_pb2.SampledSequence(tokens=encode_tokens([1, 2, 3]))
    told = types_pb2.SampledSequence(tokens=encode_tokens([1, 2]))
    told.versions.add(weights=sent, first_token=0, count=1)
    told.versions.add(weights=other, first_token=1, count=1)
    fill_spans([bare, told], sent)
    assert [(v.weights.version, v.first_token, v.count) for v in bare.versions] == [(4, 0, 3)]
    assert [(v.weights.version, v.first_token, v.count) for v in told.versions] == [(4, 0, 1), (5, 1, 1)]

    spans = PieceSpans(sent)
    pieces = [types_pb2.SampledPiece(index=0, tokens=encode_tokens([1, 2])), types_pb2.SampledPiece(index=1, tokens=encode_tokens([7])),
              types_pb2.SampledPiece(index=0, tokens=encode_tokens([3])), types_pb2.SampledPiece(index=0, stop_reason=1)]
    for piece in pieces:
        spans.fill(piece)
    assert [[(v.first_token, v.count) for v in p.versions] for p in pieces] == [[(0, 2)], [(0, 1)], [(2, 1)], []]


@pytest.mark.parametrize("fields, expected", [
    (dict(kind=types_pb2.CHECKPOINT_KIND_TRAINING), "CHECKPOINT_KIND_SAMPLER"),
    (dict(kind=types_pb2.CHECKPOINT_KIND_SAMPLER, ttl_seconds=3600), "ttl_seconds"),
    (dict(kind=types_pb2.CHECKPOINT_KIND_SAMPLER, overwrite=True), "overwrite"),
])
def test_an_inflight_save_is_an_unnamed_sampler_save(fields, expected):
    with pytest.raises(InvalidArgument, match=expected):
        check_inflight_save(service_pb2.SaveWeightsRequest(inflight=True, name="x", **fields))
    check_inflight_save(service_pb2.SaveWeightsRequest(inflight=True, name="x", kind=types_pb2.CHECKPOINT_KIND_SAMPLER))
