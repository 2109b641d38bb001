"""Temper on a local Ray cluster (deploy/ray_cluster.py): a trainer and a sampler as Ray actors, the
scheduler beside them on Postgres. A run trains; the trainer actor's process is killed with SIGKILL;
Ray starts it again on the same port; the run goes on with nothing lost — its weights equal a twin's
trained alone, its step count is exact — and sampling from it works. Both ways the scheduler learns
its workers: from their registration, and from fixed address lists. A trainer group that the model
catalogue asks for (2 CPU ranks) is restarted as a unit when one of its ranks is killed."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from fixtures_stack import sft_datum
from test_faults import metric
from test_trainer_loss import ADAM, DATA, assert_close_weights, train_alone


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def restarted_pid(deployment, role: str, old: int, timeout: float = 120.0) -> int:
    """The pid of the incarnation Ray starts after ``old`` died (calls to the dead one may fail first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = deployment.pid(role)
        except Exception:  # the call reached the dead process; Ray has not restarted it yet
            pid = old
        if pid != old:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"Ray did not restart the {role} actor within {timeout:.0f}s")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("membership", ["registry", "static"])
def test_a_run_on_ray_actors_survives_its_trainer_actor_being_killed(membership, tiny_model_dir, new_postgres_database,
                                                                     tmp_path, monkeypatch):
    from temper.client import ModelInput, SamplingParams, ServiceClient
    from temper.deploy.ray_cluster import LOOPBACK_ONLY, RayDeployment
    from temper.deploy.settings import RaySettings

    monkeypatch.setenv(LOOPBACK_ONLY, "0")  # what the deployment sets for a local cluster, undone after the test
    monkeypatch.setenv("TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS", "2")  # the scheduler process inherits it
    settings = RaySettings(num_cpus=2, base_model=tiny_model_dir, database_url=new_postgres_database("temper_ray"),
                           data_dir=tmp_path / "ray", scheduler_bind="127.0.0.1:0", trainer_port=free_port(),
                           sampler_port=free_port(), registry_host="127.0.0.1", registry_port=free_port(),
                           ready_timeout_seconds=240, membership=membership)
    with RayDeployment(settings) as deployment:
        address = deployment.start()
        trainer = deployment.of("trainer")[0].address
        with ServiceClient(address, api_key=deployment.scheduler.key_for("local")) as client:
            run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
            for tokens in DATA[:3]:
                run.forward_backward([sft_datum(tokens)]).result(timeout=120)
                run.optim_step(ADAM).result(timeout=120)

            killed = deployment.pid("trainer")
            os.kill(killed, signal.SIGKILL)
            assert restarted_pid(deployment, "trainer", killed) != killed
            assert deployment.wait_serving("trainer") == trainer  # same node, same port

            pending = [f for tokens in DATA[3:] for f in (run.forward_backward([sft_datum(tokens)]), run.optim_step(ADAM))]
            outputs = [f.result(timeout=240) for f in pending]
            assert outputs[-1].metrics["step:max"] == len(DATA)  # the adapter's own step count: none lost, none twice
            scheduler = deployment.scheduler.service("scheduler")
            assert metric(scheduler, 'temper_scheduler_runs_restored_total{outcome="restored"}') >= 1
            assert_close_weights(client, run, train_alone(client, tiny_model_dir, DATA, rank=4, seed=2), tmp_path)

            sampler = run.save_weights_and_get_sampling_client()  # the sampler actor serves the trained adapter
            out = sampler.sample(ModelInput.from_ints(DATA[0][:4]), num_samples=1,
                                 sampling_params=SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=120)
            assert len(out.sequences[0].tokens) == 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_trainer_group_from_the_catalogue_is_restarted_as_a_unit(killed, tiny_model_dir, new_postgres_database, tmp_path,
                                                                   monkeypatch):
    """The catalogue gives the tiny model 2 ranks per trainer: the deployment starts its trainer as a
    2-rank group in one STRICT_PACK placement group (a CPU bundle per rank). One rank's process is
    killed (SIGKILL): the supervisor starts both ranks again (new pids), rank 0 at the same address,
    and the scheduler restores the run, which goes on with its step count exact."""
    import json
    import threading

    from temper.client import ServiceClient
    from temper.deploy.__main__ import supervise
    from temper.deploy.ray_cluster import LOOPBACK_ONLY, RayDeployment
    from temper.deploy.settings import RaySettings

    monkeypatch.setenv(LOOPBACK_ONLY, "0")
    monkeypatch.setenv("TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS", "2")
    monkeypatch.setenv("TEMPER_TRAINER_GROUP_TIMEOUT_SECONDS", "8")
    monkeypatch.setenv("TEMPER_MODEL_CATALOGUE", json.dumps({tiny_model_dir: {"ranks_per_trainer": 2}}))
    settings = RaySettings(num_cpus=4, base_model=tiny_model_dir, database_url=new_postgres_database("temper_ray_group"),
                           data_dir=tmp_path / "ray", scheduler_bind="127.0.0.1:0", trainer_port=free_port(),
                           sampler_port=free_port(), registry_host="127.0.0.1", registry_port=free_port(),
                           ready_timeout_seconds=120)
    stop = threading.Event()
    with RayDeployment(settings) as deployment:
        address = deployment.start()
        group = deployment.of("trainer")[0]
        assert len(group.ranks) == 2 and deployment._ray.util.placement_group_table(group.group)["strategy"] == "STRICT_PACK"
        trainer, before = group.address, deployment.group_pids()
        supervisor = threading.Thread(target=supervise, args=(deployment, stop, 0.5), daemon=True)
        supervisor.start()
        try:
            with ServiceClient(address, api_key=deployment.scheduler.key_for("local")) as client:
                run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
                for tokens in DATA[:3]:
                    run.forward_backward([sft_datum(tokens)]).result(timeout=60)
                    run.optim_step(ADAM).result(timeout=60)

                os.kill(before[killed], signal.SIGKILL)
                deadline = time.monotonic() + 60
                while True:
                    try:
                        after = deployment.group_pids()
                    except Exception:  # a rank of the old group, or one not started yet
                        after = before
                    if not set(after) & set(before):
                        break
                    assert time.monotonic() < deadline, f"the group was not restarted as a unit: pids {before} -> {after}"
                    time.sleep(0.3)
                assert deployment.wait_serving("trainer") == trainer  # the same bundles, the same port

                pending = [f for tokens in DATA[3:] for f in (run.forward_backward([sft_datum(tokens)]), run.optim_step(ADAM))]
                outputs = [f.result(timeout=90) for f in pending]
                assert outputs[-1].metrics["step:max"] == len(DATA)
                assert metric(deployment.scheduler.service("scheduler"),
                              'temper_scheduler_runs_restored_total{outcome="restored"}') >= 1
        finally:
            stop.set()
            supervisor.join(timeout=30)
