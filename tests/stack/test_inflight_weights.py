"""In-flight weights on the real stack (docs/async_rl.md): two samplers, the gateway and Postgres.

Through temper.client, the unmodified tinker SDK and raw HTTP: save_weights_and_get_sampling_client
(kind="inflight") twice, and the first client's later samples run on version 2 (per-token versions;
each version's weights are those of a snapshot client on its path, compared token for token and
logprob for logprob). Bad input changes nothing. Faults: a save the trainer refuses leaves the target
where it was; a sampler killed and restarted comes back with requests on the newest target; a
scheduler killed and restarted keeps the target (never backwards) and the existing client samples on.
"""

from __future__ import annotations

import time

import grpc
import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402

from fixtures_stack import raw_stub, sft_datum  # noqa: E402
from temper.client import AdamParams, ModelInput, SamplingParams, WeightsVersion  # noqa: E402
from temper.client.versions import token_versions  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402
from temper.v1 import service_pb2, types_pb2  # noqa: E402

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
PROMPT = [3, 14, 15, 92]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
LR = AdamParams(learning_rate=5e-2)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_inflight")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("inflight"), database_url=url, num_threads=1, num_samplers=2,
                    gateway=True) as local:
        local.address = local.start()
        local.url = url
        yield local


def train(run, steps: int = 1) -> None:
    for _ in range(steps):
        run.forward_backward([sft_datum(PATTERN)]).result()
        run.optim_step(LR).result()


def greedy(sampler, **kwargs):
    return sampler.sample(ModelInput.from_ints(PROMPT), 1, GREEDY, **kwargs).result().sequences[0]


def run_info(stack, run_id: str, tenant: str = "local") -> service_pb2.TrainingRunInfo:
    return raw_stub(stack, tenant).GetInfo(service_pb2.GetInfoRequest(training_run_id=run_id), timeout=60)


def assert_on(sequence, client, version: int, path: str) -> None:
    """Every token of ``sequence`` came from ``version`` at ``path``, and a snapshot client on ``path``
    (exactly those weights) decodes the same tokens with the same logprobs."""
    assert token_versions(sequence.versions) == [version] * len(sequence.tokens)
    assert {(s.path, s.version) for s in sequence.versions} == {(path, version)}
    snapshot = greedy(client.create_sampling_client(model_path=path))
    assert snapshot.tokens == sequence.tokens
    np.testing.assert_allclose(snapshot.logprobs, sequence.logprobs, atol=1e-5)
    assert [(s.path, s.version, s.first_token, s.count) for s in snapshot.versions] == [(path, 0, 0, len(sequence.tokens))]


def test_an_inflight_client_samples_the_newest_version_through_temper_client(stack, tiny_model_dir):
    with stack.client() as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=21)
        train(run)
        first = run.save_weights_and_get_sampling_client(kind="inflight").result()
        v1 = run_info(stack, run.model_id).inflight
        assert (first.inflight_training_run_id, first.min_version, v1.version, first.model_path) == (run.model_id, 1, 1, v1.path)
        early = greedy(first)
        assert_on(early, client, 1, v1.path)

        train(run, 3)
        second = run.save_weights_and_get_sampling_client(kind="inflight").result()
        v2 = run_info(stack, run.model_id).inflight
        assert (v2.version, second.min_version) == (2, 2) and v2.path != v1.path
        later = greedy(first)  # the first client, made on version 1, now samples version 2
        assert_on(later, client, 2, v2.path)
        assert later.tokens != early.tokens  # the weights moved (three steps at a large rate)
        assert greedy(first, pin_version=True).tokens == later.tokens  # pinned: one version, the newest at its start

        scored, weights = first.compute_logprobs_with_version(ModelInput.from_ints(PROMPT + later.tokens)).result()
        assert weights == WeightsVersion(v2.path, 2)
        exact = client.create_sampling_client(model_path=v2.path).compute_logprobs(ModelInput.from_ints(PROMPT + later.tokens)).result()
        np.testing.assert_allclose(scored[1:], exact[1:], atol=1e-6)
        base = client.create_sampling_client(base_model=tiny_model_dir)
        assert greedy(base, pin_version=True).versions[0].path == ""  # pin on a fixed version: accepted, nothing changes
        _, base_weights = base.compute_logprobs_with_version(ModelInput.from_ints(PROMPT)).result()
        assert base_weights == WeightsVersion("", 0)
        listed = raw_stub(stack).ListTrainingRuns(service_pb2.ListTrainingRunsRequest(limit=1000), timeout=60).training_runs
        assert [r.inflight for r in listed if r.training_run_id == run.model_id] == [v2]
        assert raw_stub(stack).GetSamplingClient(service_pb2.GetSamplingClientRequest(sampler_id=first.sampler_id), timeout=60) \
            .model_path == v2.path


def test_the_sdk_and_raw_http_see_the_second_version(stack, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", stack.gateway_url)
    monkeypatch.setenv("TINKER_API_KEY", stack.api_key)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    sdk = tinker.ServiceClient()
    try:
        tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=22).result()
        datum = tt.Datum(model_input=tt.ModelInput.from_ints(PATTERN[:-1]), loss_fn_inputs={
            "target_tokens": np.asarray(PATTERN[1:], np.int64), "weights": np.ones(len(PATTERN) - 1, np.float32)})
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(tt.AdamParams(learning_rate=5e-2)).result()
        first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        for _ in range(3):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(tt.AdamParams(learning_rate=5e-2)).result()
        tc.save_weights_and_get_sampling_client(kind="inflight").result()
        got = first.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=8, temperature=0.0)).result()
        tokens = list(got.sequences[0].tokens)
        info = run_info(stack, tc.model_id)
        assert info.inflight.version == 2

        headers, url = {"X-API-Key": stack.api_key}, stack.gateway_url
        body = {"sampling_session_id": first._sampling_session_id, "num_samples": 1, "pin_version": True,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "sampling_params": {"max_tokens": 8, "temperature": 0.0}}
        future = httpx.post(f"{url}/api/v1/asample", headers=headers, timeout=60, json=body).json()["request_id"]
        answer = {"type": "try_again"}
        while answer.get("type") == "try_again":
            answer = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, timeout=120, json={"request_id": future}).json()
        [sequence] = answer["sequences"]
        assert sequence["tokens"] == tokens
        assert sequence["weights_versions"] == [{"path": info.inflight.path, "version": 2, "first_token": 0, "count": len(tokens)}]
        described = httpx.get(f"{url}/api/v1/samplers/{first._sampling_session_id}", headers=headers, timeout=60).json()
        assert described["model_path"] == info.inflight.path and described["inflight_training_run_id"] == tc.model_id
        assert described["min_version"] == 1
        assert sdk.create_rest_client().get_sampler(first._sampling_session_id).result().model_path == info.inflight.path
        refused = httpx.post(f"{url}/api/v1/asample", headers=headers, timeout=60, json={**body, "pin_version": "yes"})
        assert refused.status_code == 400 and "pin_version" in refused.text
    finally:
        sdk.close("success")


def test_bad_inflight_input_is_refused_and_changes_nothing(stack, tiny_model_dir):
    with stack.client() as client, stack.client("other") as other:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=23)
        fresh = client.create_lora_training_client(tiny_model_dir, rank=4, seed=23)
        theirs = other.create_lora_training_client(tiny_model_dir, rank=4, seed=23)
        theirs.save_weights_and_get_sampling_client(kind="inflight").result()
        run.save_weights_inflight().result()
        stub, before = raw_stub(stack), run_info(stack, run.model_id)

        def refused(call, request, code):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=60)
            assert err.value.code() == code, err.value.details()
            return err.value.details()

        seq = run._next_seq()
        assert "CHECKPOINT_KIND_SAMPLER" in refused(stub.SaveWeights, service_pb2.SaveWeightsRequest(
            training_run_id=run.model_id, seq_id=seq, name="x", kind=types_pb2.CHECKPOINT_KIND_TRAINING, inflight=True),
            grpc.StatusCode.INVALID_ARGUMENT)
        session = client.session_id
        for run_id, code in ((theirs.model_id, grpc.StatusCode.NOT_FOUND), ("nobody:train:0", grpc.StatusCode.NOT_FOUND),
                             (fresh.model_id, grpc.StatusCode.FAILED_PRECONDITION)):
            refused(stub.CreateSamplingClient, service_pb2.CreateSamplingClientRequest(
                session_id=session, inflight_training_run_id=run_id), code)
        assert run_info(stack, run.model_id).inflight == before.inflight
        assert run_info(stack, fresh.model_id).inflight.version == 0
        assert run_info(stack, theirs.model_id, "other").inflight.version == 1
        assert run.list_checkpoints() == []
        # the refused seq was spent and nothing else: the run's next in-flight save is version 2
        assert run.save_weights_inflight().result().version == 2


def test_a_save_the_trainer_refuses_leaves_the_target_at_the_last_durable_version(stack, tiny_model_dir):
    with stack.client() as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=24)
        train(run)
        follower = run.save_weights_and_get_sampling_client(kind="inflight").result()
        v1 = run_info(stack, run.model_id).inflight
        # files already under the name the next save uses: the trainer refuses to write over them
        (stack.data_dir / "checkpoints" / run.model_id / "sampler_weights" / "taken").mkdir(parents=True)
        seq = run._next_seq()
        with pytest.raises(grpc.RpcError) as err:
            raw_stub(stack).SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=run.model_id, seq_id=seq, name="taken",
                                                                       kind=types_pb2.CHECKPOINT_KIND_SAMPLER, inflight=True), timeout=120)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert run_info(stack, run.model_id).inflight == v1
        assert_on(greedy(follower), client, 1, v1.path)
        saved = run.save_weights_inflight().result()
        assert saved.version == 2 and run_info(stack, run.model_id).inflight == types_pb2.WeightsVersion(path=saved.path, version=2)


def test_a_restarted_sampler_serves_the_newest_target(stack, tiny_model_dir):
    with stack.client() as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=25)
        train(run)
        follower = run.save_weights_and_get_sampling_client(kind="inflight").result()
        greedy(follower)
        for sampler in [s.name for s in stack.services_of("sampler")]:
            stack.service(sampler).process.kill()  # mid-load or not: both gone, with every adapter they held
        train(run, 2)
        run.save_weights_inflight().result()  # answered without a sampler: the samplers load it later
        for sampler in [s.name for s in stack.services_of("sampler")]:
            stack.restart(sampler, crash=True)
        v2 = run_info(stack, run.model_id).inflight
        deadline = time.monotonic() + 180
        while True:
            try:
                sequence = greedy(follower)
                break
            except Exception:  # noqa: BLE001 - until the scheduler sees the samplers again
                assert time.monotonic() < deadline
                time.sleep(1)
        assert_on(sequence, client, 2, v2.path)


def test_a_restarted_scheduler_keeps_the_target_and_the_client_samples_on(stack, tiny_model_dir):
    with stack.client() as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=26)
        train(run)
        run.save_weights_inflight().result()
        train(run)
        follower = run.save_weights_and_get_sampling_client(kind="inflight").result()
        v2 = run_info(stack, run.model_id).inflight
        assert v2.version == 2
        stack.restart_scheduler(crash=True)
        assert run_info(stack, run.model_id).inflight == v2  # read back from Postgres
        assert_on(greedy(follower), client, 2, v2.path)  # the client made before the crash samples on
        train(run)
        assert run.save_weights_inflight().result().version == 3  # never backwards, never a version twice
        v3 = run_info(stack, run.model_id).inflight
        assert_on(greedy(follower), client, 3, v3.path)
