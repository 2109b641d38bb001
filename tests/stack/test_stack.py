"""The real scheduler, trainer and sampler processes, driven only through the client (tiny model,
scheduler on Postgres)."""

from pathlib import Path

import grpc
import numpy as np
import pytest

from fixtures_stack import adapter_weights, assert_same_weights, request_rows, sft_datum, raw_stub
from temper.client import AdamParams, AlreadyExists, InvalidArgument, ModelInput, NotFound, SamplingParams
from temper.client import convert
from temper.v1 import service_pb2, service_pb2_grpc

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
ADAM = AdamParams(learning_rate=5e-3, eps=1e-8, grad_clip_norm=1.0)


def test_server_capabilities(service_client, tiny_model_dir):
    caps = service_client.get_server_capabilities()
    assert [(m.model_name, m.trainable, m.sampleable) for m in caps.supported_models] == [(tiny_model_dir, True, True)]


def test_sft_trains_saves_and_samples_the_trained_adapter(service_client, tiny_model_dir, postgres_url):
    tc = service_client.create_lora_training_client(tiny_model_dir, rank=8, seed=0)
    datum = sft_datum(PATTERN)
    losses = []
    while len(losses) < 150 and (not losses or losses[-1] > 0.05):  # memorize: every token p > 0.99
        fb = tc.forward_backward([datum])       # submitted together: one scheduler cycle
        step = tc.optim_step(ADAM)
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["step:max"] == len(losses)
    assert losses[-1] < 0.05, losses

    saved = tc.save_weights_for_sampler("memorized").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/memorized"
    [listed] = tc.list_checkpoints()
    assert (listed.tinker_path, listed.checkpoint_type) == (saved.path, "sampler")
    assert listed.size_bytes > 0

    prompt = ModelInput.from_ints(PATTERN[:3])
    greedy = SamplingParams(max_tokens=len(PATTERN) - 3, temperature=0.0, stop=[])
    trained = service_client.create_sampling_client(model_path=saved.path).sample(prompt, 1, greedy).result()
    base = service_client.create_sampling_client(base_model=tiny_model_dir).sample(prompt, 1, greedy).result()
    assert trained.sequences[0].tokens == PATTERN[3:]
    assert base.sequences[0].tokens != PATTERN[3:]
    assert trained.sequences[0].stop_reason == "length"

    # sampler logprobs of the saved adapter agree with the trainer's for the same tokens
    sampler = service_client.create_sampling_client(model_path=saved.path)
    sampler_lp = sampler.compute_logprobs(ModelInput.from_ints(PATTERN)).result()
    trainer_lp = tc.forward([datum]).result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert sampler_lp[0] is None
    np.testing.assert_allclose(np.array(sampler_lp[1:], dtype=np.float32), trainer_lp, atol=1e-4)

    rows = request_rows(postgres_url, tc.model_id)
    assert [r[2] for r in rows] == ["done"] * len(rows)
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1))


def test_retried_seq_returns_first_result_and_runs_once(service_client, stack, tiny_model_dir, postgres_url, tmp_path):
    stub = raw_stub(stack)
    twin_a = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=11)
    twin_b = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=11)
    datum = convert.datum_to_proto(sft_datum(PATTERN))

    def fb(run, seq):
        return service_pb2.ForwardBackwardRequest(training_run_id=run, seq_id=seq, data=[datum], loss_fn="cross_entropy")

    first = stub.ForwardBackward(fb(twin_a.model_id, 1))
    retry = stub.ForwardBackward(fb(twin_a.model_id, 1))
    assert retry == first
    other = service_pb2.ForwardBackwardRequest(training_run_id=twin_a.model_id, seq_id=1, data=[datum], loss_fn="cross_entropy", forward_only=True)
    with pytest.raises(grpc.RpcError) as err:
        stub.ForwardBackward(other)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.ForwardBackward(fb(twin_b.model_id, 1))
    for twin in (twin_a, twin_b):
        step = service_pb2.OptimStepRequest(training_run_id=twin.model_id, seq_id=2, adam_params=convert.adam_to_proto(ADAM))
        stub.OptimStep(step)
        stub.OptimStep(step)  # retried step: the same answer, not a second step
    # If the retry had run again, A's gradient would have been doubled before the step.
    paths = [stub.SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=t.model_id, seq_id=3, name="after", kind=1)).checkpoint.path
             for t in (twin_a, twin_b)]
    assert_same_weights(adapter_weights(service_client, paths[0], tmp_path), adapter_weights(service_client, paths[1], tmp_path))
    assert request_rows(postgres_url, twin_a.model_id) == [(1, "forward_backward", "done"), (2, "optim_step", "done"), (3, "save_weights", "done")]


def test_bad_input_gets_the_right_status_and_changes_nothing(service_client, tiny_model_dir, postgres_url, tmp_path):
    clean = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=5)
    dirty = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=5)
    good = sft_datum(PATTERN)
    vocab = dirty.get_info().vocab_size

    bad_dtype = sft_datum(PATTERN)
    bad_dtype.loss_fn_inputs["target_tokens"] = type(bad_dtype.loss_fn_inputs["weights"])(
        data=np.asarray(PATTERN[1:], np.float32), dtype="float32", shape=[len(PATTERN) - 1])
    mismatched = sft_datum(PATTERN, weights=[1.0] * (len(PATTERN) + 2))
    out_of_vocab = sft_datum(PATTERN[:-1] + [vocab + 5])

    dirty.forward_backward([good]).result()
    rows_before = request_rows(postgres_url, dirty.model_id)
    checkpoints_before = dirty.list_checkpoints()
    for data, loss, match in [
        ([bad_dtype], "cross_entropy", "must be int64"),
        ([mismatched], "cross_entropy", "shape"),
        ([out_of_vocab], "cross_entropy", "outside the vocabulary"),
        ([good], "no_such_loss", "unknown loss_fn"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            dirty.forward_backward(data, loss_fn=loss).result()
    with pytest.raises(InvalidArgument, match="eps"):
        dirty.optim_step(AdamParams(learning_rate=1e-3, eps=0.0)).result()
    with pytest.raises(NotFound):
        dirty.load_state(f"tinker://{dirty.model_id}/weights/never-saved").result()
    with pytest.raises(NotFound):
        service_client.create_sampling_client(model_path=f"tinker://{dirty.model_id}/sampler_weights/nope").result()
    with pytest.raises(NotFound):
        service_client.training_client("no-such-session:train:0")
    assert request_rows(postgres_url, dirty.model_id) == rows_before  # rejected requests write no rows
    assert dirty.list_checkpoints() == checkpoints_before

    # The rejected requests spent their seq ids but nothing else: later work runs, and the adapter
    # ends exactly where its twin (same seed, only the good requests) does.
    clean.forward_backward([good]).result()
    for tc in (clean, dirty):
        tc.optim_step(ADAM).result()
    paths = [tc.save_weights_for_sampler("final").result().path for tc in (clean, dirty)]
    assert_same_weights(adapter_weights(service_client, paths[0], tmp_path), adapter_weights(service_client, paths[1], tmp_path))

    with pytest.raises(AlreadyExists):
        dirty.save_weights_for_sampler("final").result()


def test_unknown_run_and_base_model_are_not_found(stack):
    stub = raw_stub(stack)
    with pytest.raises(grpc.RpcError) as err:
        stub.OptimStep(service_pb2.OptimStepRequest(training_run_id="nope:train:0", seq_id=1))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    session = stub.CreateSession(service_pb2.CreateSessionRequest()).session_id
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=session, base_model="not/a-model",
                                                                    lora_config={"rank": 4, "train_mlp": True}))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_and_reflection_are_served(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(stack.address)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="temper.v1.Temper"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "temper.v1.Temper" in names


def test_health_watch_streams_serving_on_every_service(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for role in ("scheduler", "trainer", "sampler"):
        with grpc.insecure_channel(stack.service(role).address) as channel:
            stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            # the scheduler listens before its workers answer (NOT_SERVING), then streams SERVING
            statuses = []
            for reply in stream:
                statuses.append(reply.status)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            stream.cancel()
            assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING, (role, statuses)


def scrape(url: str) -> dict[str, float]:
    """Sample name with labels -> value, from a Prometheus text exposition."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {name + (str(sorted(labels.items())) if labels else ""): value
            for family in text_string_to_metric_families(text) for name, labels, value, *_ in family.samples}


def series(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_every_service_serves_its_metrics(service_client, stack, tiny_model_dir):
    before = {role: scrape(stack.service(role).metrics_url) for role in ("scheduler", "trainer", "sampler")}
    tc = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=0)
    tc.forward_backward([sft_datum(PATTERN)]).result()
    tc.optim_step(ADAM).result()
    sampler = service_client.create_sampling_client(base_model=tiny_model_dir)
    sampler.sample(ModelInput.from_ints([1, 2, 3]), 2, SamplingParams(max_tokens=4, temperature=0.0)).result()
    after = {role: scrape(stack.service(role).metrics_url) for role in ("scheduler", "trainer", "sampler")}
    tokens = len(PATTERN) - 1

    def moved(role, prefix):
        return series(after[role], prefix) - series(before[role], prefix)

    assert moved("scheduler", "temper_scheduler_tokens_trained_total") == tokens
    assert moved("scheduler", "temper_scheduler_admissions_total") == 2
    assert moved("scheduler", "temper_scheduler_cycles_total") >= 1
    assert moved("scheduler", "temper_scheduler_cycle_seconds_count") >= 1
    assert moved("scheduler", "temper_scheduler_cycle_tokens_sum") == tokens
    assert moved("scheduler", "temper_scheduler_tokens_sampled_total") == 8
    assert any(k.startswith("temper_scheduler_queued_requests[") for k in after["scheduler"])  # per tenant
    assert moved("trainer", "temper_trainer_tokens_trained_total") == tokens
    assert moved("trainer", "temper_trainer_optim_steps_total") == 1
    assert moved("trainer", "temper_trainer_cycle_seconds_count") >= 1
    assert series(after["trainer"], "temper_trainer_resident_adapters") >= 1
    assert series(after["trainer"], "temper_trainer_rss_bytes") > 0
    assert moved("sampler", "temper_sampler_tokens_sampled_total") == 8
    assert moved("sampler", "temper_sampler_batch_sequences_count") >= 1


def test_forward_backward_custom_equals_the_builtin_loss(service_client, tiny_model_dir, tmp_path):
    import torch

    builtin = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=31)
    custom = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=31)
    data = [sft_datum(PATTERN), sft_datum(PATTERN[:7], weights=[0.5, 1, 2, 0, 1, 1])]

    def weighted_nll(batch, logprobs):
        loss = sum((-lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom_metric:mean": 1.5}

    for _ in range(2):
        want = builtin.forward_backward(data).result()
        got = custom.forward_backward_custom(data, weighted_nll).result()
        builtin.optim_step(ADAM)
        custom.optim_step(ADAM)
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
        assert got.metrics["custom_metric:mean"] == 1.5
        for a, b in zip(got.loss_fn_outputs, want.loss_fn_outputs):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
    paths = [tc.save_weights_for_sampler("custom").result().path for tc in (builtin, custom)]
    a, b = (adapter_weights(service_client, p, tmp_path) for p in paths)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-6, err_msg=key)


def test_sampled_logprobs_match_the_trainer(service_client, tiny_model_dir):
    tc = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=41)
    tc.forward_backward([sft_datum(PATTERN)])
    tc.optim_step(ADAM).result()
    sampler = tc.save_weights_and_get_sampling_client("parity")
    prompt = PATTERN[:4]
    out = sampler.sample(ModelInput.from_ints(prompt), 3, SamplingParams(max_tokens=10, seed=7, stop=[]), topk_logprobs=2).result()
    assert len({tuple(s.tokens) for s in out.sequences}) > 1
    for seq in out.sequences:
        full = prompt + seq.tokens
        trainer_lp = tc.forward([sft_datum(full)]).result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(np.asarray(seq.logprobs, np.float32), trainer_lp[-len(seq.tokens):], atol=1e-4)
        assert len(seq.topk_logprobs) == len(seq.tokens) and all(len(p) == 2 for p in seq.topk_logprobs)


def test_trainer_runs_under_the_tuned_host_allocator(stack):
    from temper.common.host_allocator import TUNED_MALLOC_ENV, is_glibc_linux

    if not is_glibc_linux():
        pytest.fail("this test reads /proc/<pid>/environ of a glibc Linux process")
    pid = stack.service("trainer").process.pid  # the same pid after the re-exec
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
    assert {k: environ.get(k) for k in TUNED_MALLOC_ENV} == TUNED_MALLOC_ENV


def test_a_closed_session_stops_its_runs_and_sampling_clients(stack, tiny_model_dir):
    from temper.client import FailedPrecondition, ServiceClient

    client = stack.client()
    run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=0)
    run.forward_backward([sft_datum(PATTERN)]).result()
    sampler = client.create_sampling_client(base_model=tiny_model_dir)
    sampler.sample(ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=2, temperature=0.0)).result()
    client.close()
    with stack.client() as other:  # the same ids, from a new session of the same tenant
        with pytest.raises(FailedPrecondition, match="closed"):
            other.training_client(run.model_id).optim_step(ADAM).result()
        stub = raw_stub(stack)
        with pytest.raises(grpc.RpcError) as err:
            stub.Sample(service_pb2.SampleRequest(sampler_id=sampler.sampler_id, num_samples=1,
                                                  prompt=convert.model_input_to_proto(ModelInput.from_ints([1, 2, 3])),
                                                  sampling_params=convert.sampling_params_to_proto(SamplingParams(max_tokens=2))))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
