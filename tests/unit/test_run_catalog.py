"""The run and checkpoint catalog without a stack: the store's listings and run numbers on SQLite,
rows as API messages (scheduler/db/views.py), and the gateway's and client's renderings of them."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from temper.client import rest_client
from temper.common.errors import AlreadyExists, InvalidArgument, NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.db.views import checkpoint_message, run_message
from temper.services.gateway import convert
from temper.services.gateway.errors import GatewayError
from temper.v1 import service_pb2, trainer_pb2, types_pb2

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'temper.db'}"
    upgrade_schema(url)
    yield Store(url)


def add_run(store: Store, session_id: str, created: datetime, index: int | None = None) -> m.TrainingRun:
    run = m.TrainingRun(id=store.reserve_run_id(session_id, index), session_id=session_id, base_model="b", lora_rank=4,
                        lora_alpha=8.0, seed=3, train_attn=True, train_mlp=False, train_unembed=True,
                        user_metadata={"renderer": "r"}, created_at=created, last_request_at=created)
    return store.add_training_run(run)


def test_run_numbers_asked_for_skip_ahead_and_never_repeat(store):
    session = store.create_session("alice", [], {}).id
    assert store.reserve_run_id(session) == f"{session}:train:0"
    assert store.reserve_run_id(session, 3) == f"{session}:train:3"
    assert store.reserve_run_id(session) == f"{session}:train:4"
    for taken in (0, 2, 4):
        with pytest.raises(AlreadyExists):
            store.reserve_run_id(session, taken)
    assert store.reserve_run_id(session) == f"{session}:train:5"  # a refused number changed nothing
    with pytest.raises(NotFound):
        store.reserve_run_id("no-such-session")


def test_a_refused_creation_gives_its_run_number_back_unless_a_later_one_moved_on(store):
    session = store.create_session("alice", [], {}).id
    ahead = store.reserve_run(session, 3)
    assert store.give_back_run(session, ahead)
    first = store.reserve_run(session)
    assert first.run_id == f"{session}:train:0"  # as if the refused one had never asked for number 3
    later = store.reserve_run(session)
    assert not store.give_back_run(session, first)  # a later reservation holds the counter: 0 stays skipped
    assert store.give_back_run(session, later) and store.reserve_run_id(session) == f"{session}:train:1"


def test_a_tenants_runs_newest_first_a_page_at_a_time(store):
    mine, theirs = store.create_session("alice", [], {}).id, store.create_session("bob", [], {}).id
    runs = [add_run(store, mine, T0 + timedelta(minutes=i)) for i in range(3)]
    add_run(store, theirs, T0 + timedelta(hours=1))
    page, total = store.tenant_runs("alice", 2, 0)
    assert [r.id for r in page] == [runs[2].id, runs[1].id] and total == 3
    page, total = store.tenant_runs("alice", 2, 2)
    assert [r.id for r in page] == [runs[0].id] and total == 3
    assert store.tenant_runs("nobody", 5, 0) == ([], 0)
    assert set(store.run_rows([runs[0].id, "missing"])) == {runs[0].id} and store.run_rows([]) == {}


def test_a_checkpoint_with_its_run_for_its_owner_or_once_published(store):
    session = store.create_session("alice", [], {}).id
    run = add_run(store, session, T0)
    path = f"tinker://{run.id}/weights/s1"
    store.add_checkpoint(run.id, "training", "s1", path, 10, user_metadata={"step": "1"})
    row, source = store.readable_checkpoint_and_run(path, "alice")
    assert source.id == run.id and row.user_metadata == {"step": "1"}
    with pytest.raises(NotFound, match=f"^checkpoint {path} not found$"):
        store.readable_checkpoint_and_run(path, "bob")
    store.update_checkpoint(path, "alice", True, False)
    assert store.readable_checkpoint_and_run(path, "bob")[1].id == run.id


def row_run() -> m.TrainingRun:
    return m.TrainingRun(id="s:train:0", session_id="s", base_model="base", lora_rank=8, lora_alpha=16.0, lora_dropout=0.0, seed=None,
                         train_attn=True, train_mlp=True, train_unembed=False, user_metadata={"renderer": "llama3"},
                         created_at=T0, last_request_at=T0 + timedelta(seconds=30))


def test_rows_as_api_messages():
    model = trainer_pb2.ModelInfo(tokenizer_id="tok", vocab_size=99, max_context_length=64)
    info = run_message(row_run(), "alice", 7, model)
    assert (info.owner, dict(info.user_metadata), info.next_seq_id, info.tokenizer_id) == ("alice", {"renderer": "llama3"}, 7, "tok")
    assert info.last_request_unix_ms - info.created_unix_ms == 30_000 and not info.lora_config.HasField("seed")
    assert run_message(row_run(), "alice", 1, None).tokenizer_id == ""  # no trainer of the model now
    ckpt = m.Checkpoint(training_run_id="s:train:0", kind="training", name="n", path="tinker://s:train:0/weights/n", size_bytes=5,
                        created_at=T0.replace(tzinfo=None), published=False, expires_at=None, user_metadata=None)
    msg = checkpoint_message(ckpt, row_run())
    assert (msg.base_model, msg.lora_config.rank, dict(msg.user_metadata), msg.checkpoint_id) == ("base", 8, {}, "weights/n")
    assert checkpoint_message(ckpt).base_model == ""


def test_gateway_and_client_renderings():
    info = run_message(row_run(), "alice", 1, None)
    ckpt = types_pb2.Checkpoint(checkpoint_id="weights/n", kind=types_pb2.CHECKPOINT_KIND_TRAINING, path="tinker://s:train:0/weights/n",
                                training_run_id="s:train:0", created_unix_ms=info.created_unix_ms + 1000, base_model="base",
                                lora_config=info.lora_config, user_metadata={"step": "2"})
    body = convert.training_run_to_json(info, [ckpt])
    assert body["model_owner"] == "alice" and body["user_metadata"] == {"renderer": "llama3"}
    assert body["last_request_time"] == (T0 + timedelta(seconds=30)).isoformat()  # newer than the checkpoint
    assert body["last_checkpoint"]["user_metadata"] == {"step": "2"} and body["last_checkpoint"]["base_model"] == "base"
    assert convert.weights_info_to_json(ckpt) == {"base_model": "base", "optimizer_config": {"type": "adamw"}, "is_lora": True,
                                                  "lora_rank": 8, "train_unembed": False, "train_mlp": True, "train_attn": True}
    assert convert.metadata_from_json({"user_metadata": {"a": 1}}) == {"a": "1"} and convert.metadata_from_json({}) == {}
    with pytest.raises(GatewayError):
        convert.metadata_from_json({"user_metadata": ["not", "an", "object"]})
    run = rest_client._training_run(info, [ckpt])
    assert run.model_owner == "alice" and run.user_metadata == {"renderer": "llama3"}
    assert run.last_checkpoint.user_metadata == {"step": "2"} and run.last_request_time == T0 + timedelta(seconds=30)


def test_user_metadata_is_bounded():
    from temper.scheduler.api.lookup_verbs import check_user_metadata

    check_user_metadata({"k": "v" * 100})
    with pytest.raises(InvalidArgument):
        check_user_metadata({str(i): "" for i in range(65)})
    with pytest.raises(InvalidArgument):
        check_user_metadata({"k": "v" * 5000})
    assert service_pb2.CreateTrainingRunRequest(run_index=0).HasField("run_index")
