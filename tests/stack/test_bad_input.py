"""Bad input through raw stubs, one class at a time: every answer is INVALID_ARGUMENT (or NOT_FOUND)
with a short message that carries no SQL and no unbounded echo of the input, and nothing changes:
no row, no checkpoint, no adapter weights (a twin run that got only the good requests ends equal)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import adapter_weights, assert_same_weights, request_rows, sft_datum, raw_stub
from temper.client import AdamParams, Datum, ModelInput, convert
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
NUL = "a\x00b"


@pytest.fixture
def raw(stack):
    yield raw_stub(stack)


def refused(call, *args, code=grpc.StatusCode.INVALID_ARGUMENT, metadata=None) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, metadata=metadata, timeout=60)
    assert err.value.code() == code, err.value.details()
    details = err.value.details()
    assert len(details) < 400 and not any(word in details for word in ("SELECT", "INSERT", "psycopg2", "sqlalchemy", "\x00"))
    return details


def fb(run_id: str, seq: int, datum=None, loss_fn="cross_entropy", config=None) -> service_pb2.ForwardBackwardRequest:
    return service_pb2.ForwardBackwardRequest(training_run_id=run_id, seq_id=seq, data=[convert.datum_to_proto(datum or sft_datum(PATTERN))],
                                              loss_fn=loss_fn, loss_fn_config=config or {})


def test_ids_paths_and_keys_are_checked_before_they_reach_sql(raw, stack, service_client, tiny_model_dir, postgres_url):
    run = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
    rows = request_rows(postgres_url, run.model_id)
    refused(raw.GetInfo, service_pb2.GetInfoRequest(training_run_id=NUL))
    refused(raw.ForwardBackward, fb(run.model_id + "\x00", 1))
    refused(raw.Heartbeat, service_pb2.HeartbeatRequest(session_id=NUL))
    refused(raw.CloseSession, service_pb2.CloseSessionRequest(session_id=NUL))
    refused(raw.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(session_id=service_client.session_id, base_model=NUL,
                                                                        lora_config=types_pb2.LoraConfig(rank=4, train_mlp=True)))
    refused(raw.Sample, service_pb2.SampleRequest(sampler_id=NUL, num_samples=1))
    refused(raw.ListCheckpoints, service_pb2.ListCheckpointsRequest(training_run_id="r" * 10_000))
    details = refused(raw.LoadWeights, service_pb2.LoadWeightsRequest(training_run_id=run.model_id, seq_id=1,
                                                                      path=f"tinker://{run.model_id}/weights/" + "x" * 100_000))
    assert "100" in details or "characters" in details
    refused(raw.CreateSession, service_pb2.CreateSessionRequest(user_metadata={"k": NUL}))
    refused(raw.CreateSession, service_pb2.CreateSessionRequest(tags=["t"] * 1000))
    keyless = service_pb2_grpc.TemperStub(grpc.insecure_channel(stack.address))
    for key in ("tml-" + "t" * 5000, "tml-a b", "not-a-key", ""):
        details = refused(keyless.CreateSession, service_pb2.CreateSessionRequest(), code=grpc.StatusCode.UNAUTHENTICATED,
                          metadata=[("authorization", f"Bearer {key}")])
        assert "t" * 100 not in details
    assert request_rows(postgres_url, run.model_id) == rows


def test_shapes_whose_element_count_overflows_are_refused(raw, service_client, tiny_model_dir):
    run = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
    request = fb(run.model_id, 1)
    request.data[0].loss_fn_inputs["weights"].CopyFrom(types_pb2.Tensor(dtype=types_pb2.DTYPE_FLOAT32, shape=[2**62, 4], data=b""))
    assert "bytes" in refused(raw.ForwardBackward, request)


def test_values_and_configs_that_cannot_be_meaningful_are_refused(raw, service_client, tiny_model_dir, postgres_url, tmp_path):
    dirty = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
    clean = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
    huge = sft_datum(PATTERN, weights=[3e38] * (len(PATTERN) - 1))
    assert "magnitude" in refused(raw.ForwardBackward, fb(dirty.model_id, 1, huge))
    n = len(PATTERN) - 1

    def rl_datum(logprob: float) -> Datum:
        return Datum(model_input=ModelInput.from_ints(PATTERN[:-1]), loss_fn_inputs={
            "target_tokens": np.asarray(PATTERN[1:], np.int64), "logprobs": np.full(n, logprob, np.float32),
            "advantages": np.ones(n, np.float32)})

    refused(raw.ForwardBackward, fb(dirty.model_id, 2, rl_datum(-1e30), loss_fn="importance_sampling"))
    ok_rl = rl_datum(-1.0)
    config = {"clip_low_threshold": types_pb2.LossConfigValue(number=1.5), "clip_high_threshold": types_pb2.LossConfigValue(number=0.5)}
    assert "clip_low_threshold <= clip_high_threshold" in refused(raw.ForwardBackward, fb(dirty.model_id, 3, ok_rl, "ppo", config))
    session = service_client.session_id
    for lora in (types_pb2.LoraConfig(rank=4, alpha=float("nan"), train_mlp=True), types_pb2.LoraConfig(rank=4, alpha=float("inf"), train_mlp=True)):
        refused(raw.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(session_id=session, base_model=tiny_model_dir, lora_config=lora))
    name = refused(raw.SaveWeights, service_pb2.SaveWeightsRequest(training_run_id=dirty.model_id, seq_id=4, name="final\n",
                                                                  kind=types_pb2.CHECKPOINT_KIND_SAMPLER))
    assert "control characters" in name
    assert request_rows(postgres_url, dirty.model_id) == [] and dirty.list_checkpoints() == []

    # the rejected requests spent seqs 1-4 and nothing else: the run goes on and ends as its twin does
    for _ in range(4):
        dirty._next_seq()  # the raw requests above used them
    for tc in (clean, dirty):
        tc.forward_backward([sft_datum(PATTERN)]).result()
        tc.optim_step(AdamParams(learning_rate=5e-3, eps=1e-8)).result()
    paths = [tc.save_weights_for_sampler("final").result().path for tc in (clean, dirty)]
    assert_same_weights(adapter_weights(service_client, paths[0], tmp_path), adapter_weights(service_client, paths[1], tmp_path))


def test_sampling_options_and_prompt_lengths_are_checked(raw, service_client, tiny_model_dir):
    sampler = service_client.create_sampling_client(base_model=tiny_model_dir)
    prompt = types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(
        encoded_text=types_pb2.EncodedTextChunk(tokens=np.asarray([1, 2, 3], "<i4").tobytes()))])

    def sample(**params):
        return service_pb2.SampleRequest(sampler_id=sampler.sampler_id, prompt=prompt, num_samples=1,
                                         sampling_params=types_pb2.SamplingParams(max_tokens=4, **params))

    assert "temperature" in refused(raw.Sample, sample(temperature=1e-45))
    assert "stop strings" in refused(raw.Sample, sample(temperature=1.0, stop_strings=[""]))
    raw.Sample(sample(temperature=1e-3, stop_strings=["x"]), timeout=60)  # the bounds themselves are fine
    context = service_client.get_server_capabilities().supported_models[0].max_context_length
    long_prompt = types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(
        encoded_text=types_pb2.EncodedTextChunk(tokens=np.ones(context + 1, "<i4").tobytes()))])
    assert "context length" in refused(raw.ComputeLogprobs, service_pb2.ComputeLogprobsRequest(sampler_id=sampler.sampler_id,
                                                                                              prompt=long_prompt))


def test_bounds_the_trainer_needs_are_checked_at_admission(raw, service_client, tiny_model_dir, postgres_url, tmp_path):
    """What a float32 trainer cannot run is refused by the scheduler (no row, nothing applied); what
    it can, even at the bounds, runs with a finite answer."""
    dirty = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=5)
    clean = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=5)
    seq = 0

    def step(**adam) -> service_pb2.OptimStepRequest:
        nonlocal seq
        seq += 1
        return service_pb2.OptimStepRequest(training_run_id=dirty.model_id, seq_id=seq, adam_params=types_pb2.AdamParams(**adam))

    for adam in (dict(learning_rate=1e38, eps=1e-8), dict(learning_rate=1e300, eps=1e-8), dict(learning_rate=1e30, eps=1e-8),
                 dict(learning_rate=1e-3, eps=1e-8, weight_decay=1e12), dict(learning_rate=1e-4, eps=1e-50)):
        refused(raw.OptimStep, step(**adam))
    seq += 1
    for key in ("kl_coeff", "beta"):
        loss_fn = "stable_reinforce" if key == "kl_coeff" else "dro"
        datum = Datum(model_input=ModelInput.from_ints(PATTERN[:-1]), loss_fn_inputs={
            "target_tokens": np.asarray(PATTERN[1:], np.int64), "logprobs": np.full(len(PATTERN) - 1, -1.0, np.float32),
            "advantages": np.ones(len(PATTERN) - 1, np.float32)})
        refused(raw.ForwardBackward, fb(dirty.model_id, seq, datum, loss_fn, {key: types_pb2.LossConfigValue(number=1e300)}))
        seq += 1
    request = fb(dirty.model_id, seq)
    for i in range(250):
        request.data[0].loss_fn_inputs[f"{i:03d}" + "k" * 253].CopyFrom(request.data[0].loss_fn_inputs["weights"])
    assert "250 in all" in refused(raw.ForwardBackward, request)
    for far in (2**63 - 1, 2**62):  # refused without spending anything: no seq, no row
        refused(raw.ForwardBackward, fb(dirty.model_id, far))
    refused(raw.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(
        session_id=service_client.session_id, base_model=tiny_model_dir, run_index=2**31 - 1,
        lora_config=types_pb2.LoraConfig(rank=4, train_mlp=True)))
    assert request_rows(postgres_url, dirty.model_id) == [] and dirty.list_checkpoints() == []

    # the rejected requests spent their seqs and nothing else: the run goes on and ends as its twin does
    for _ in range(seq):
        dirty._next_seq()
    for tc in (clean, dirty):
        tc.forward_backward([sft_datum(PATTERN)]).result()
        tc.optim_step(AdamParams(learning_rate=5e-3, eps=1e-8)).result()
    paths = [tc.save_weights_for_sampler("final").result().path for tc in (clean, dirty)]
    assert_same_weights(adapter_weights(service_client, paths[0], tmp_path), adapter_weights(service_client, paths[1], tmp_path))

    # sampler logprobs far below the current ones (allowed: |x| <= 1e6) train with a finite loss
    n = len(PATTERN) - 1
    for loss_fn in ("importance_sampling", "ppo", "stable_reinforce"):
        extreme = Datum(model_input=ModelInput.from_ints(PATTERN[:-1]), loss_fn_inputs={
            "target_tokens": np.asarray(PATTERN[1:], np.int64), "logprobs": np.full(n, -1e5, np.float32),
            "advantages": np.full(n, -1.0, np.float32)})
        out = clean.forward_backward([extreme], loss_fn).result()
        assert np.isfinite(out.metrics["loss:sum"])


def test_sampling_requests_the_sampler_would_refuse_are_refused_first(raw, service_client, tiny_model_dir):
    sampler = service_client.create_sampling_client(base_model=tiny_model_dir)
    prompt = types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(
        encoded_text=types_pb2.EncodedTextChunk(tokens=np.asarray([1, 2, 3], "<i4").tobytes()))])
    for num_samples, params, topk in ((1, dict(max_tokens=0), 0), (1, dict(max_tokens=4, temperature=float("nan")), 0),
                                      (1, dict(max_tokens=4, top_p=float("nan")), 0), (65, dict(max_tokens=4), 0),
                                      (1, dict(max_tokens=4), -1)):
        refused(raw.Sample, service_pb2.SampleRequest(sampler_id=sampler.sampler_id, prompt=prompt, num_samples=num_samples,
                                                      topk_logprobs=topk, sampling_params=types_pb2.SamplingParams(**params)))


def test_inflight_requests_that_cannot_be_served_are_refused_and_change_nothing(raw, stack, service_client, tiny_model_dir,
                                                                                postgres_url):
    """docs/async_rl.md: an in-flight save of a training checkpoint, with a TTL or overwriting; an in-flight
    client on another tenant's run, an unknown run, a run without an in-flight save. No row, no
    checkpoint, no sampling client, no move of any target."""
    run = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=7)
    with stack.client("mallory") as other:
        theirs = other.create_lora_training_client(tiny_model_dir, rank=4, seed=7)
        theirs.save_weights_inflight().result()
    info = raw.GetInfo(service_pb2.GetInfoRequest(training_run_id=run.model_id), timeout=60)
    for seq, extra in ((1, dict(kind=types_pb2.CHECKPOINT_KIND_TRAINING)), (2, dict(kind=types_pb2.CHECKPOINT_KIND_SAMPLER, ttl_seconds=3600)),
                       (3, dict(kind=types_pb2.CHECKPOINT_KIND_SAMPLER, overwrite=True))):
        refused(raw.SaveWeights, service_pb2.SaveWeightsRequest(training_run_id=run.model_id, seq_id=seq, name="v", inflight=True, **extra))
    session = service_client.session_id
    for run_id, code in ((theirs.model_id, grpc.StatusCode.NOT_FOUND), (f"{session}:train:999", grpc.StatusCode.NOT_FOUND),
                         (run.model_id, grpc.StatusCode.FAILED_PRECONDITION)):
        refused(raw.CreateSamplingClient, service_pb2.CreateSamplingClientRequest(session_id=session, inflight_training_run_id=run_id),
                code=code)
    assert raw.GetInfo(service_pb2.GetInfoRequest(training_run_id=run.model_id), timeout=60).inflight == info.inflight
    assert request_rows(postgres_url, run.model_id) == [] and run.list_checkpoints() == []
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        clients = conn.execute(text("select count(*) from sampling_clients where session_id = :s"), {"s": session}).scalar()
    engine.dispose()
    assert clients == 0
