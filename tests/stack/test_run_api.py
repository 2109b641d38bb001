"""The run and checkpoint lookups of the public API through raw stubs on the real stack: run
metadata, owner and times on TrainingRunInfo; ListTrainingRuns; creating a run from a checkpoint in
one call (own, and another tenant's published one); GetCheckpoint (weights info); checkpoint
metadata and overwriting saves; GetSamplingClient. Another tenant's objects answer NOT_FOUND with the
text of a missing one; bad input answers INVALID_ARGUMENT and changes nothing."""

from __future__ import annotations

import grpc
import pytest

from fixtures_stack import raw_stub, sft_datum
from temper.client import AdamParams, convert
from temper.v1 import service_pb2, types_pb2

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
LORA = types_pb2.LoraConfig(rank=4, alpha=8.0, seed=11, train_attn=True, train_mlp=False, train_unembed=True)


def code_of(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request)
    return caught.value.code(), caught.value.details()


def session(stub) -> str:
    return stub.CreateSession(service_pb2.CreateSessionRequest()).session_id


def new_run(stub, session_id, model, **fields) -> service_pb2.TrainingRunInfo:
    return stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=session_id, base_model=model, lora_config=LORA,
                                                                       **fields))


def train_step(stub, run_id: str, seq: int) -> float:
    """forward_backward at ``seq``, optim_step at ``seq + 1``; the loss."""
    out = stub.ForwardBackward(service_pb2.ForwardBackwardRequest(
        training_run_id=run_id, seq_id=seq, data=[convert.datum_to_proto(sft_datum(PATTERN))], loss_fn="cross_entropy"))
    stub.OptimStep(service_pb2.OptimStepRequest(training_run_id=run_id, seq_id=seq + 1,
                                                adam_params=convert.adam_to_proto(AdamParams(learning_rate=1e-2))))
    return out.metrics["loss:sum"]


def forward_loss(stub, run_id: str, seq: int) -> float:
    return stub.ForwardBackward(service_pb2.ForwardBackwardRequest(
        training_run_id=run_id, seq_id=seq, data=[convert.datum_to_proto(sft_datum(PATTERN))], loss_fn="cross_entropy",
        forward_only=True)).metrics["loss:sum"]


def save(stub, run_id, seq, name, kind=types_pb2.CHECKPOINT_KIND_TRAINING, **fields) -> types_pb2.Checkpoint:
    return stub.SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=run_id, seq_id=seq, name=name, kind=kind, **fields)).checkpoint


def test_run_info_and_listing(stack, tiny_model_dir):
    stub, other = raw_stub(stack, "runapi-list"), raw_stub(stack, "runapi-list-other")
    sid = session(stub)
    first = new_run(stub, sid, tiny_model_dir, user_metadata={"renderer": "llama3"})
    assert dict(first.user_metadata) == {"renderer": "llama3"} and first.owner == "runapi-list"
    assert first.created_unix_ms > 0 and first.last_request_unix_ms >= first.created_unix_ms
    second = new_run(stub, sid, tiny_model_dir)
    train_step(stub, first.training_run_id, 1)
    info = stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=first.training_run_id))
    assert dict(info.user_metadata) == {"renderer": "llama3"} and info.next_seq_id == 3
    assert info.last_request_unix_ms >= second.created_unix_ms  # moved by the training requests

    listed = stub.ListTrainingRuns(service_pb2.ListTrainingRunsRequest())
    assert [r.training_run_id for r in listed.training_runs] == [second.training_run_id, first.training_run_id]
    assert listed.total_count == 2 and listed.training_runs[1].next_seq_id == 3
    assert listed.training_runs[1].tokenizer_id and dict(listed.training_runs[1].user_metadata) == {"renderer": "llama3"}
    page = stub.ListTrainingRuns(service_pb2.ListTrainingRunsRequest(limit=1, offset=1))
    assert [r.training_run_id for r in page.training_runs] == [first.training_run_id] and page.total_count == 2
    assert stub.ListTrainingRuns(service_pb2.ListTrainingRunsRequest(offset=5)).training_runs == []
    for bad in (dict(limit=-1), dict(offset=-1), dict(limit=1001)):
        assert code_of(stub.ListTrainingRuns, service_pb2.ListTrainingRunsRequest(**bad))[0] == grpc.StatusCode.INVALID_ARGUMENT

    # another tenant sees none of it
    assert other.ListTrainingRuns(service_pb2.ListTrainingRunsRequest()).total_count == 0
    hidden = code_of(other.GetInfo, service_pb2.GetInfoRequest(training_run_id=first.training_run_id))
    missing = code_of(other.GetInfo, service_pb2.GetInfoRequest(training_run_id=first.training_run_id + "0"))
    assert hidden[0] == missing[0] == grpc.StatusCode.NOT_FOUND
    assert hidden[1].replace(first.training_run_id, "X") == missing[1].replace(first.training_run_id + "0", "X")


def test_create_from_checkpoint(stack, tiny_model_dir):
    alice, bob = raw_stub(stack, "runapi-alice"), raw_stub(stack, "runapi-bob")
    sid = session(alice)
    source = new_run(alice, sid, tiny_model_dir)
    train_step(alice, source.training_run_id, 1)
    state = save(alice, source.training_run_id, 3, "s1", user_metadata={"renderer": "role_colon"})
    sampler_ckpt = save(alice, source.training_run_id, 4, "w1", kind=types_pb2.CHECKPOINT_KIND_SAMPLER)
    assert dict(state.user_metadata) == {"renderer": "role_colon"} and state.base_model == tiny_model_dir
    assert state.lora_config == source.lora_config

    # own checkpoint, with its optimizer: one call, no seq used; the LoRA config is the checkpoint's
    resumed = alice.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
        session_id=sid, from_path=state.path, with_optimizer=True, user_metadata={"resumed": "yes"}))
    assert resumed.next_seq_id == 1 and resumed.lora_config == source.lora_config and resumed.base_model == tiny_model_dir
    assert resumed.training_run_id == f"{sid}:train:1" and dict(resumed.user_metadata) == {"resumed": "yes"}
    at_state = forward_loss(alice, resumed.training_run_id, 1)
    assert at_state == forward_loss(alice, source.training_run_id, 5)
    assert train_step(alice, resumed.training_run_id, 2) == train_step(alice, source.training_run_id, 6)  # same Adam state

    # bad input: INVALID_ARGUMENT, and the session's next run number is untouched
    for bad in (dict(from_path="not-a-path"), dict(from_path=sampler_ckpt.path, with_optimizer=True),
                dict(from_path=state.path, base_model="other/model"), dict(with_optimizer=True, lora_config=LORA,
                                                                             base_model=tiny_model_dir),
                dict(from_path=state.path, run_index=-1)):
        code, _ = code_of(alice.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(session_id=sid, **bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
    # a number asked for: taken ones are refused, later ones skip ahead
    assert code_of(alice.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(session_id=sid, from_path=state.path,
                                                                               run_index=1))[0] == grpc.StatusCode.ALREADY_EXISTS
    assert new_run(alice, sid, tiny_model_dir).training_run_id == f"{sid}:train:2"
    assert new_run(alice, sid, tiny_model_dir, run_index=5).training_run_id == f"{sid}:train:5"
    assert new_run(alice, sid, tiny_model_dir).training_run_id == f"{sid}:train:6"

    # another tenant: the unpublished checkpoint is as missing as a path that does not exist
    bob_sid = session(bob)
    for path in (state.path, state.path + "x"):
        code, details = code_of(bob.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(session_id=bob_sid, from_path=path))
        assert (code, details) == (grpc.StatusCode.NOT_FOUND, f"checkpoint {path} not found")
        code, details = code_of(bob.GetCheckpoint, service_pb2.GetCheckpointRequest(path=path))
        assert (code, details) == (grpc.StatusCode.NOT_FOUND, f"checkpoint {path} not found")
    assert bob.ListTrainingRuns(service_pb2.ListTrainingRunsRequest()).total_count == 0  # nothing was made

    # published: weights info and a run from it, without any access to its run
    alice.UpdateCheckpoint(service_pb2.UpdateCheckpointRequest(path=state.path, published=True))
    weights = bob.GetCheckpoint(service_pb2.GetCheckpointRequest(path=state.path))
    assert weights.base_model == tiny_model_dir and weights.lora_config.rank == 4 and not weights.lora_config.train_mlp
    theirs = bob.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=bob_sid, from_path=state.path))
    assert theirs.owner == "runapi-bob" and theirs.lora_config == source.lora_config and theirs.next_seq_id == 1
    assert forward_loss(bob, theirs.training_run_id, 1) == at_state
    assert code_of(bob.GetInfo, service_pb2.GetInfoRequest(training_run_id=source.training_run_id))[0] == grpc.StatusCode.NOT_FOUND
    assert code_of(bob.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(
        session_id=bob_sid, from_path=sampler_ckpt.path))[0] == grpc.StatusCode.NOT_FOUND  # that one is still unpublished


def test_overwriting_save_and_checkpoint_metadata(stack, tiny_model_dir):
    stub = raw_stub(stack, "runapi-save")
    sid = session(stub)
    run = new_run(stub, sid, tiny_model_dir).training_run_id
    first = save(stub, run, 1, "ckpt", user_metadata={"step": "0"})
    loss0 = train_step(stub, run, 2)
    assert code_of(stub.SaveWeights, service_pb2.SaveWeightsRequest(
        training_run_id=run, seq_id=4, name="ckpt", kind=types_pb2.CHECKPOINT_KIND_TRAINING))[0] == grpc.StatusCode.ALREADY_EXISTS
    # refused before it runs (a bad ttl): the old checkpoint stays
    assert code_of(stub.SaveWeights, service_pb2.SaveWeightsRequest(
        training_run_id=run, seq_id=5, name="ckpt", kind=types_pb2.CHECKPOINT_KIND_TRAINING, overwrite=True,
        ttl_seconds=-1))[0] == grpc.StatusCode.INVALID_ARGUMENT
    listed = stub.ListCheckpoints(service_pb2.ListCheckpointsRequest(training_run_id=run)).checkpoints
    assert [(c.path, c.created_unix_ms, dict(c.user_metadata)) for c in listed] == [(first.path, first.created_unix_ms, {"step": "0"})]

    second = save(stub, run, 6, "ckpt", overwrite=True, user_metadata={"step": "1"})
    listed = stub.ListCheckpoints(service_pb2.ListCheckpointsRequest(training_run_id=run)).checkpoints
    assert [c.path for c in listed] == [first.path] and dict(listed[0].user_metadata) == {"step": "1"}
    assert listed[0].base_model == tiny_model_dir and listed[0].lora_config.rank == 4
    assert second.created_unix_ms >= first.created_unix_ms
    # the overwritten checkpoint holds the trained weights: a run from it scores as the run does now
    again = stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=sid, from_path=second.path))
    assert forward_loss(stub, again.training_run_id, 1) == forward_loss(stub, run, 7) != loss0


def test_get_sampling_client(stack, tiny_model_dir):
    stub, other = raw_stub(stack, "runapi-sampler"), raw_stub(stack, "runapi-sampler-other")
    sid = session(stub)
    made = stub.CreateSamplingClient(service_pb2.CreateSamplingClientRequest(session_id=sid, base_model=tiny_model_dir))
    got = stub.GetSamplingClient(service_pb2.GetSamplingClientRequest(sampler_id=made.sampler_id))
    assert got == made
    hidden = code_of(other.GetSamplingClient, service_pb2.GetSamplingClientRequest(sampler_id=made.sampler_id))
    missing = code_of(other.GetSamplingClient, service_pb2.GetSamplingClientRequest(sampler_id=made.sampler_id + "9"))
    assert hidden[0] == missing[0] == grpc.StatusCode.NOT_FOUND
    assert hidden[1].replace(made.sampler_id, "X") == missing[1].replace(made.sampler_id + "9", "X")


def test_temper_client_runs_and_published_resume(stack, tiny_model_dir):
    """temper.client over the same verbs: RestClient runs (metadata, owner, newest first), checkpoint
    metadata, weights info and a training client from another tenant's published checkpoint."""
    from temper.client import NotFound
    from temper.client import types as t

    owner, other = stack.client("runapi-client"), stack.client("runapi-client-other")
    try:
        tc = owner.create_lora_training_client(tiny_model_dir, rank=4, seed=9, user_metadata={"renderer": "qwen3"})
        tc.forward_backward([sft_datum(PATTERN)], "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        saved = tc.save_state("c1", user_metadata={"epoch": "1"}).result()
        assert saved.checkpoint.user_metadata == {"epoch": "1"} and saved.checkpoint.base_model == tiny_model_dir
        tc.save_state("c1", overwrite=True).result()
        resumed = owner.create_training_client_from_state_with_optimizer(saved.path, user_metadata={"resumed": "1"}).result()
        rest = owner.create_rest_client()
        runs = rest.list_training_runs().result()
        assert [r.training_run_id for r in runs.training_runs] == [resumed.model_id, tc.model_id] and runs.cursor.total_count == 2
        assert runs.training_runs[1].user_metadata == {"renderer": "qwen3"} and runs.training_runs[1].model_owner == "runapi-client"
        assert runs.training_runs[1].last_checkpoint.tinker_path == saved.path
        assert rest.get_training_run(resumed.model_id).result().user_metadata == {"resumed": "1"}

        other_rest = other.create_rest_client()
        with pytest.raises(NotFound):
            other_rest.get_weights_info_by_tinker_path(saved.path).result()
        with pytest.raises(NotFound):
            other.create_training_client_from_state(saved.path).result()
        owner.publish_checkpoint(saved.path)
        info = other_rest.get_weights_info_by_tinker_path(saved.path).result()
        assert info == t.WeightsInfoResponse(base_model=tiny_model_dir, is_lora=True, lora_rank=4, train_unembed=True,
                                             train_mlp=True, train_attn=True)
        theirs = other.create_training_client_from_state(saved.path).result()
        want = resumed.forward([sft_datum(PATTERN)], "cross_entropy").result().metrics["loss:sum"]
        assert theirs.forward([sft_datum(PATTERN)], "cross_entropy").result().metrics["loss:sum"] == want
        sampler = owner.create_sampling_client(base_model=tiny_model_dir)
        assert rest.get_sampler(sampler.sampler_id).result().base_model == tiny_model_dir
        with pytest.raises(NotFound):
            other_rest.get_sampler(sampler.sampler_id).result()
    finally:
        owner.close()
        other.close()
