"""Workers that register themselves (registry.proto) instead of a static address list, on the real
processes and Postgres: two registered trainers share the runs; a third started later takes new
runs; a trainer SIGKILLed mid-stream comes back as a new incarnation and its run trains on with
nothing lost (weights equal a twin's); a restarted scheduler learns its workers again from their
heartbeats; and the registry admits only the internal token."""

from __future__ import annotations

import grpc
import pytest

from fixtures_stack import request_rows, sft_datum
from temper.client import ModelInput, SamplingParams
from temper.v1 import registry_pb2, registry_pb2_grpc
from test_faults import log_count, metric, wait_until
from test_scaleout import on_each_trainer
from test_trainer_loss import ADAM, DATA, assert_close_weights, train_alone


@pytest.fixture(scope="module")
def registered(tiny_model_dir, new_postgres_database, tmp_path_factory):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_registration")
    env = {"TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS": "2", "TEMPER_TRAINER_HEARTBEAT_SECONDS": "0.5",
           "TEMPER_SAMPLER_HEARTBEAT_SECONDS": "0.5"}
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("registration"), database_url=url, num_threads=1,
                    num_trainers=2, registration=True, extra_env=env) as local:
        local.address = local.start()
        local.url = url
        yield local


def resident(stack, name: str) -> float:
    return metric(stack.service(name), "temper_trainer_resident_adapters")


def wait_all_trainers_placeable(stack) -> None:
    """Every trainer of the stack registered, and none marked down (a restarted one is back)."""
    stack.wait_registered({"trainer": len(stack.services_of("trainer"))}, timeout=120)
    wait_until(lambda: metric(stack.service("scheduler"), "temper_scheduler_trainers_down") == 0, 120, "no trainer down")


def test_registered_trainers_share_runs_a_later_one_takes_new_ones_and_a_restart_loses_nothing(registered, tiny_model_dir,
                                                                                                tmp_path):
    stack = registered
    scheduler = stack.service("scheduler")
    assert "TRAINER_ADDRESSES" not in str(scheduler.env) and metric(scheduler, 'temper_scheduler_workers{role="trainer"}') == 2
    with stack.client() as client:
        runs = on_each_trainer(stack, client, tiny_model_dir, seed=2, rank=4)  # spread over both registered trainers
        for tokens in DATA[:3]:
            for tc in runs.values():
                tc.forward_backward([sft_datum(tokens)]).result(timeout=300)
                tc.optim_step(ADAM).result(timeout=300)

        # a third trainer, started now, registers and takes the next run (it holds the fewest)
        stack.add_worker("trainer")
        before = resident(stack, "trainer-2")
        late = client.create_lora_training_client(tiny_model_dir, rank=4, seed=3).result(timeout=300)
        assert resident(stack, "trainer-2") == before + 1
        late.forward_backward([sft_datum(DATA[0])]).result(timeout=300)
        assert late.optim_step(ADAM).result(timeout=300).metrics["step:max"] == 1

        # SIGKILL "trainer" with its run's requests in flight; it comes back on its port as a new incarnation
        run = runs["trainer"]
        pending = [f for tokens in DATA[3:] for f in (run.forward_backward([sft_datum(tokens)]), run.optim_step(ADAM))]
        stack.restart("trainer", crash=True)
        outputs = [f.result(timeout=600) for f in pending]  # every call succeeds, some late
        assert outputs[-1].metrics["step:max"] == len(DATA)  # none lost, none applied twice
        assert request_rows(stack.url, run.model_id) == [(seq, "forward_backward" if seq % 2 else "optim_step", "done")
                                                         for seq in range(1, 2 * len(DATA) + 1)]
        # its new incarnation registers (maybe after the run was already restored: by fail-over or on a NotFound)
        restarted = f"trainer {stack.service('trainer').address} restarted (incarnation"
        wait_until(lambda: log_count(scheduler, restarted) >= 1, 120, "the restarted trainer registering again")
        assert log_count(scheduler, restarted) == 1
        twin = train_alone(client, tiny_model_dir, DATA, rank=4, seed=2)
        assert_close_weights(client, run, twin, tmp_path)

        # the registered sampler serves the trained adapter
        sampler = run.save_weights_and_get_sampling_client("registered")
        out = sampler.sample(ModelInput.from_ints([1, 2, 3]), num_samples=1,
                             sampling_params=SamplingParams(max_tokens=4, temperature=0.0, stop=[])).result(timeout=300)
        assert len(out.sequences[0].tokens) == 4


def test_a_restarted_scheduler_learns_its_workers_again_from_their_heartbeats(registered, tiny_model_dir):
    stack = registered
    wait_all_trainers_placeable(stack)  # the previous test restarted one
    with stack.client() as client:
        runs = on_each_trainer(stack, client, tiny_model_dir, seed=4, rank=2)
        stack.restart_scheduler()
        stack.wait_registered({"trainer": 3, "sampler": 1}, timeout=120)  # NOT_FOUND heartbeats: registered again
        for tc in runs.values():  # resent by the client until the run's trainer is known again
            tc.forward_backward([sft_datum(DATA[1])]).result(timeout=300)
            assert tc.optim_step(ADAM).result(timeout=300).metrics["step:max"] == 1


def test_the_registry_admits_only_the_internal_token(registered):
    address = f"127.0.0.1:{registered.service('scheduler').registry_port}"
    request = registry_pb2.RegisterRequest(role=registry_pb2.WORKER_ROLE_TRAINER, address="127.0.0.1:1", incarnation="x")
    for metadata in ((), (("authorization", f"Bearer {registered.api_key}"),), (("authorization", "Bearer wrong"),)):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                registry_pb2_grpc.RegistryStub(channel).Register(request, metadata=metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
