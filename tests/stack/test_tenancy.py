"""Tenants who cannot see each other, on the real three-process stack and Postgres: API keys and
their lifecycle (the admin command), every cross-tenant access through raw stubs (NOT_FOUND, nothing
changed), publishing, hard limits, checkpoint deletion, TTL and snapshot collection."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import adapter_weights, assert_same_weights, raw_stub, request_rows, sft_datum
from temper.client import AdamParams, ModelInput, NotFound, ResourceExhausted, SamplingParams, convert
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2

REPO = Path(__file__).resolve().parents[2]
PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
ADAM = AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def tenancy_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    """Its own database; keys trusted for 0.5 s, checkpoints collected every 0.5 s, snapshots idle after
    2 s, and a sampler that holds 2 adapters."""
    from temper.localstack import LocalStack

    env = {"TEMPER_SCHEDULER_KEY_CACHE_SECONDS": "0.5", "TEMPER_SCHEDULER_CHECKPOINT_GC_INTERVAL_SECONDS": "0.5",
           "TEMPER_SCHEDULER_SNAPSHOT_IDLE_SECONDS": "2", "TEMPER_SAMPLER_MAX_ADAPTERS": "2"}
    url = new_postgres_database("temper_tenancy")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("tenancy"), database_url=url, extra_env=env, num_threads=1) as local:
        local.address = local.start()
        yield local


def admin(stack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TEMPER_SCHEDULER_DATABASE_URL": stack.database_url}
    return subprocess.run([sys.executable, "-m", "temper.scheduler.admin", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def keyed_stub(stack, key: str | None):
    stub = service_pb2_grpc.TemperStub(grpc.insecure_channel(stack.address))
    metadata = [("authorization", f"Bearer {key}")] if key is not None else []
    return stub, metadata


def code_of(call, request, metadata=None) -> tuple[grpc.StatusCode, str]:
    try:
        result = call(request, metadata=metadata, timeout=60)
        if hasattr(result, "__next__"):  # a stream fails when read
            list(result)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def rows(url: str, query: str) -> list[tuple]:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = [tuple(r) for r in conn.execute(text(query)).all()]
    engine.dispose()
    return found


def test_key_lifecycle_through_the_admin_command(tenancy_stack):
    created = admin(tenancy_stack, "create-key", "--tenant", "dora", "--label", "laptop")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("tml-") and len(key) > 40 and created.stdout == key + "\n"  # the key alone on stdout
    stub, metadata = keyed_stub(tenancy_stack, key)
    assert stub.CreateSession(service_pb2.CreateSessionRequest(), metadata=metadata).session_id
    # only a hash and a prefix are stored
    stored = rows(tenancy_stack.database_url, "select prefix, key_sha256, last_used_at from api_keys where label = 'laptop'")
    assert len(stored) == 1 and key.startswith(stored[0][0]) and key not in stored[0][1] and stored[0][2] is not None
    listing = admin(tenancy_stack, "list-keys", "--tenant", "dora")
    assert listing.returncode == 0 and stored[0][0] in listing.stdout and key not in listing.stdout

    for bad in (None, "tml-" + "x" * 43, "sk-not-ours"):
        bad_stub, bad_metadata = keyed_stub(tenancy_stack, bad)
        assert code_of(bad_stub.CreateSession, service_pb2.CreateSessionRequest(), bad_metadata)[0] == grpc.StatusCode.UNAUTHENTICATED

    revoked = admin(tenancy_stack, "revoke-key", stored[0][0])
    assert revoked.returncode == 0, revoked.stderr
    deadline = time.monotonic() + 30  # the scheduler trusts a looked-up key for key_cache_seconds (0.5 here)
    while (status := code_of(stub.CreateSession, service_pb2.CreateSessionRequest(), metadata))[0] == grpc.StatusCode.OK:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert status[0] == grpc.StatusCode.UNAUTHENTICATED and "revoked" in status[1]


def test_health_needs_no_key(tenancy_stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(tenancy_stack.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="temper.v1.Temper"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_another_tenant_sees_nothing_and_changes_nothing(tenancy_stack, tiny_model_dir, tmp_path):
    url = tenancy_stack.database_url
    with tenancy_stack.client("alice") as alice:
        run = alice.create_lora_training_client(tiny_model_dir, rank=4, seed=3)
        run.forward_backward([sft_datum(PATTERN)]).result()
        run.optim_step(ADAM).result()
        run.forward_backward([sft_datum(PATTERN)]).result()  # gradients pending: a stolen step would apply them
        state = run.save_state("state").result().path
        weights = run.save_weights_for_sampler("weights").result().path
        sampler = alice.create_sampling_client(model_path=weights)
        before = {"weights": adapter_weights(alice, weights, tmp_path / "a"), "state": adapter_weights(alice, state, tmp_path / "b"),
                  "requests": request_rows(url, run.model_id),
                  "checkpoints": rows(url, "select path, size_bytes, published from checkpoints order by id"),
                  "sessions": rows(url, f"select id, closed_at from sessions where id = '{alice.session_id}'")}

        bob = raw_stub(tenancy_stack, "bob")
        bob_session = bob.CreateSession(service_pb2.CreateSessionRequest()).session_id
        bob_run = bob.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
            session_id=bob_session, base_model=tiny_model_dir, lora_config={"rank": 4, "train_mlp": True})).training_run_id
        datum = convert.datum_to_proto(sft_datum(PATTERN))
        prompt = convert.model_input_to_proto(ModelInput.from_ints([1, 2, 3]))
        params = convert.sampling_params_to_proto(SamplingParams(max_tokens=2))
        attempts = {
            "GetInfo": service_pb2.GetInfoRequest(training_run_id=run.model_id),
            "ForwardBackward": service_pb2.ForwardBackwardRequest(training_run_id=run.model_id, seq_id=5, data=[datum],
                                                                  loss_fn="cross_entropy"),
            "OptimStep": service_pb2.OptimStepRequest(training_run_id=run.model_id, seq_id=5, adam_params=convert.adam_to_proto(ADAM)),
            "SaveWeights": service_pb2.SaveWeightsRequest(training_run_id=run.model_id, seq_id=5, name="stolen",
                                                          kind=types_pb2.CHECKPOINT_KIND_SAMPLER),
            "LoadWeights": service_pb2.LoadWeightsRequest(training_run_id=run.model_id, seq_id=5, path=state),
            "CreateSamplingClient": service_pb2.CreateSamplingClientRequest(session_id=bob_session, model_path=weights),
            "Sample": service_pb2.SampleRequest(sampler_id=sampler.sampler_id, prompt=prompt, num_samples=1, sampling_params=params),
            "ComputeLogprobs": service_pb2.ComputeLogprobsRequest(sampler_id=sampler.sampler_id, prompt=prompt),
            "ListCheckpoints": service_pb2.ListCheckpointsRequest(training_run_id=run.model_id),
            "DownloadCheckpoint": service_pb2.DownloadCheckpointRequest(path=state),
            "UpdateCheckpoint": service_pb2.UpdateCheckpointRequest(path=weights, published=True),
            "DeleteCheckpoint": service_pb2.DeleteCheckpointRequest(path=state),
            "Heartbeat": service_pb2.HeartbeatRequest(session_id=alice.session_id),
            "CloseSession": service_pb2.CloseSessionRequest(session_id=alice.session_id),
            "CreateTrainingRun": service_pb2.CreateTrainingRunRequest(session_id=alice.session_id, base_model=tiny_model_dir,
                                                                      lora_config={"rank": 4, "train_mlp": True}),
        }
        for method, request in attempts.items():
            code, details = code_of(getattr(bob, method), request)
            assert code == grpc.StatusCode.NOT_FOUND, (method, code, details)
        # into bob's own run, alice's private checkpoint is as absent as one that never existed
        code, details = code_of(bob.LoadWeights, service_pb2.LoadWeightsRequest(training_run_id=bob_run, seq_id=1, path=state))
        assert code == grpc.StatusCode.NOT_FOUND and details == f"checkpoint {state} not found"
        missing = state.replace("/weights/state", "/weights/never")
        assert code_of(bob.DownloadCheckpoint, service_pb2.DownloadCheckpointRequest(path=missing))[1] == f"checkpoint {missing} not found"
        with tenancy_stack.client("bob") as bob_client:  # the same through the client
            for attempt in (lambda: bob_client.training_client(run.model_id), lambda: bob_client.list_checkpoints(run.model_id),
                            lambda: bob_client.create_sampling_client(model_path=weights).result(),
                            lambda: bob_client.download_checkpoint(state, tmp_path / "stolen"),
                            lambda: bob_client.publish_checkpoint(weights), lambda: bob_client.delete_checkpoint(state)):
                with pytest.raises(NotFound):
                    attempt()
        usage = bob.GetUsage(service_pb2.GetUsageRequest())
        assert usage.tenant == "bob" and [r.training_run_id for r in usage.runs] == [bob_run]
        assert [c.path for c in bob.ListCheckpoints(service_pb2.ListCheckpointsRequest()).checkpoints] == []

        # nothing of alice's changed: rows, files, weights, optimizer state; and her run goes on at its seq
        assert request_rows(url, run.model_id) == before["requests"]
        assert rows(url, "select path, size_bytes, published from checkpoints order by id") == before["checkpoints"]
        assert rows(url, f"select id, closed_at from sessions where id = '{alice.session_id}'") == before["sessions"]
        assert_same_weights(adapter_weights(alice, weights, tmp_path / "c"), before["weights"])
        assert_same_weights(adapter_weights(alice, state, tmp_path / "d"), before["state"])
        assert run.optim_step(ADAM).result() is not None
        assert [r[0] for r in request_rows(url, run.model_id)] == list(range(1, len(before["requests"]) + 2))


def test_a_published_checkpoint_is_readable_and_loadable_but_not_writable(tenancy_stack, tiny_model_dir, tmp_path):
    with tenancy_stack.client("erin") as erin, tenancy_stack.client("fred") as fred:
        source = erin.create_lora_training_client(tiny_model_dir, rank=4, seed=5)
        source.forward_backward([sft_datum(PATTERN)]).result()
        source.optim_step(ADAM).result()
        state = source.save_state("shared").result().path
        assert erin.publish_checkpoint(state).public
        assert [c.public for c in erin.list_checkpoints(source.model_id)] == [True]

        copy = fred.create_lora_training_client(tiny_model_dir, rank=4, seed=6)
        copy.load_state_with_optimizer(state).result()  # into fred's own run
        mine = copy.save_state("mine").result().path
        assert_same_weights(adapter_weights(fred, mine, tmp_path / "m"), adapter_weights(fred, state, tmp_path / "s"))
        stub = raw_stub(tenancy_stack, "fred")
        for method, request in {"UpdateCheckpoint": service_pb2.UpdateCheckpointRequest(path=state, published=False),
                                "DeleteCheckpoint": service_pb2.DeleteCheckpointRequest(path=state),
                                "SaveWeights": service_pb2.SaveWeightsRequest(training_run_id=source.model_id, seq_id=9, name="x",
                                                                              kind=types_pb2.CHECKPOINT_KIND_TRAINING)}.items():
            assert code_of(getattr(stub, method), request)[0] == grpc.StatusCode.NOT_FOUND, method

        erin.unpublish_checkpoint(state)
        with pytest.raises(NotFound):
            fred.download_checkpoint(state, tmp_path / "after")


def test_withdrawn_access_ends_the_sampling_clients_made_while_it_was_granted(tenancy_stack, tiny_model_dir):
    """Issue 21, edge 4: the samplers still hold the adapter; the next call answers NOT_FOUND all the same."""
    prompt, params = ModelInput.from_ints([1, 2, 3]), SamplingParams(max_tokens=2, temperature=0.0)
    with tenancy_stack.client("ivy") as ivy, tenancy_stack.client("jon") as jon:
        run = ivy.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
        path = run.save_weights_for_sampler("shared").result().path
        ivy.publish_checkpoint(path)
        theirs, mine = jon.create_sampling_client(model_path=path).result(), ivy.create_sampling_client(model_path=path).result()
        assert theirs.sample(prompt, 1, params).result().sequences and mine.sample(prompt, 1, params).result().sequences
        ivy.unpublish_checkpoint(path)
        with pytest.raises(NotFound):
            theirs.sample(prompt, 1, params).result()
        with pytest.raises(NotFound):
            theirs.compute_logprobs(prompt).result()
        assert mine.sample(prompt, 1, params).result().sequences  # the owner's goes on until the checkpoint goes
        ivy.delete_checkpoint(path)
        with pytest.raises(NotFound):
            mine.sample(prompt, 1, params).result()


def test_hard_limits_answer_resource_exhausted_naming_the_limit(tenancy_stack, tiny_model_dir):
    assert admin(tenancy_stack, "set-quota", "--tenant", "gina", "--max-training-runs", "1", "--max-storage-bytes", "1").returncode == 0
    shown = admin(tenancy_stack, "show-quota", "--tenant", "gina").stdout
    assert "max_training_runs = 1" in shown and "train_tokens_per_minute = default" in shown
    with tenancy_stack.client("gina") as gina:
        run = gina.create_lora_training_client(tiny_model_dir, rank=4, seed=1).result(timeout=300)  # created: it holds the quota
        stub = raw_stub(tenancy_stack, "gina")
        code, details = code_of(stub.CreateTrainingRun, service_pb2.CreateTrainingRunRequest(
            session_id=gina.session_id, base_model=tiny_model_dir, lora_config={"rank": 4, "train_mlp": True}))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_training_runs = 1" in details and "in use: 1" in details
        with pytest.raises(ResourceExhausted, match="max_training_runs"):  # a hard limit: the client does not retry it
            gina.create_lora_training_client(tiny_model_dir, rank=4, seed=1).result()
        # 0 bytes used before it, but the save itself is bytes: refused, nothing written (issue 21, edge 7)
        with pytest.raises(ResourceExhausted, match="max_storage_bytes = 1 reached"):
            run.save_weights_for_sampler("first").result()
        for kind in (types_pb2.CHECKPOINT_KIND_SAMPLER, types_pb2.CHECKPOINT_KIND_TRAINING):
            code, details = code_of(stub.SaveWeights, service_pb2.SaveWeightsRequest(
                training_run_id=run.model_id, seq_id=1 + kind, name="second", kind=kind))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_storage_bytes = 1 reached (in use: 0)" in details
        assert not (Path(tenancy_stack.data_dir) / "checkpoints" / run.model_id).exists()
        assert rows(tenancy_stack.database_url, f"select path from checkpoints where training_run_id = '{run.model_id}'") == []
        usage = gina.get_usage()
        assert usage["limits"]["max_training_runs"] == {"limit": 1, "used": 1.0, "wait_seconds": 0.0}
        assert usage["limits"]["max_storage_bytes"]["used"] == usage["storage_bytes"] == 0
    with tenancy_stack.client("gina") as again:  # the first session closed: its run no longer counts
        assert again.create_lora_training_client(tiny_model_dir, rank=4, seed=2).model_id


def test_delete_ttl_and_snapshot_collection(tenancy_stack, tiny_model_dir):
    checkpoints = Path(tenancy_stack.data_dir) / "checkpoints"
    with tenancy_stack.client("hal") as hal:
        run = hal.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
        named = run.save_weights_for_sampler("named").result()
        folder = checkpoints / named.path.removeprefix("tinker://")
        assert folder.is_dir()
        assert hal.delete_checkpoint(named.path) == named.checkpoint.size_bytes > 0
        assert not folder.exists() and hal.list_checkpoints(run.model_id) == []
        with pytest.raises(NotFound):
            hal.delete_checkpoint(named.path)

        expiring = run.save_weights_for_sampler("expiring", ttl_seconds=1).result()
        assert expiring.checkpoint.expires_at is not None
        snapshots = [run.save_weights_and_get_sampling_client().result() for _ in range(3)]
        assert [c.tinker_path for c in hal.list_checkpoints(run.model_id)] == [expiring.path]  # snapshots are unlisted
        deadline = time.monotonic() + 60
        while True:  # expired, and the two older idle snapshots, go; the newest snapshot stays
            left = sorted(p.name for p in (checkpoints / run.model_id / "sampler_weights").iterdir() if not p.name.startswith("."))
            if len(left) == 1:
                break
            assert time.monotonic() < deadline, left
            time.sleep(0.5)
        assert left == [snapshots[-1].model_path.rsplit("/", 1)[1]]
        assert hal.list_checkpoints(run.model_id) == []
        tokens = snapshots[-1].sample(ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=2, temperature=0.0)).result()
        assert len(tokens.sequences[0].tokens) == 2
        with pytest.raises(NotFound):
            snapshots[0].sample(ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=2)).result()


def _trained_versions(client, tiny_model_dir, versions: int):
    run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
    samplers = []
    for i in range(versions):
        run.forward_backward([sft_datum(PATTERN)]).result()
        run.optim_step(ADAM).result()
        samplers.append(run.save_weights_and_get_sampling_client(f"v{i}"))
    return samplers


def test_the_sampler_evicts_and_reloads_adapters_on_demand_with_the_same_answers(tenancy_stack, tiny_model_dir):
    import urllib.request

    prompt = ModelInput.from_ints(PATTERN)
    with tenancy_stack.client("ivan") as ivan:
        samplers = _trained_versions(ivan, tiny_model_dir, 4)  # 4 versions, a sampler that holds 2
        first = [s.compute_logprobs(prompt).result()[1:] for s in samplers]
        again = [s.compute_logprobs(prompt).result()[1:] for s in reversed(samplers)][::-1]
    assert first == again  # every reload answers exactly as before
    assert len({tuple(values) for values in first}) == 4  # and each is its own version
    metrics = urllib.request.urlopen(tenancy_stack.service("sampler").metrics_url, timeout=30).read().decode()
    evictions = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("temper_sampler_adapter_evictions_total")]
    assert evictions and evictions[0] >= 4


def test_a_tenants_resident_adapters_are_bounded_by_its_own_limit(tenancy_stack, tiny_model_dir):
    assert admin(tenancy_stack, "set-quota", "--tenant", "judy", "--max-resident-adapters", "1").returncode == 0
    prompt = ModelInput.from_ints(PATTERN)
    with tenancy_stack.client("judy") as judy:
        a, b = _trained_versions(judy, tiny_model_dir, 2)
        answers = [s.compute_logprobs(prompt).result()[1:] for s in (a, b, a, b)]
        usage = judy.get_usage()["limits"]["max_resident_adapters"]
    assert answers[0] == answers[2] and answers[1] == answers[3] and answers[0] != answers[1]
    assert usage["limit"] == 1 and usage["used"] == 1.0
