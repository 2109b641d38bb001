"""Temper on a local Ray cluster (deploy/ray_cluster.py): a trainer and a sampler as Ray actors, the
scheduler beside them on Postgres. A run trains; the trainer actor's process is killed with SIGKILL;
Ray starts it again on the same port; the run goes on with nothing lost — its weights equal a twin's
trained alone, its step count is exact — and sampling from it works. Both ways the scheduler learns
its workers: from their registration, and from fixed address lists. Each way is its own deployment,
on one Ray cluster that the module starts once (ray_fixtures.py). Trainer groups: test_ray_groups.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fixtures_stack import sft_datum
from ray_fixtures import free_port, ray_cluster
from test_faults import metric
from test_trainer_loss import ADAM, DATA, assert_close_weights, train_alone


@pytest.fixture(scope="module")
def ray_runtime():
    with ray_cluster(num_cpus=2) as ray:  # a trainer and a sampler, one CPU each
        yield ray


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
def test_a_run_on_ray_actors_survives_its_trainer_actor_being_killed(membership, ray_runtime, tiny_model_dir,
                                                                     new_postgres_database, tmp_path, monkeypatch):
    from temper.client import ModelInput, SamplingParams, ServiceClient
    from temper.deploy.ray_cluster import RayDeployment
    from temper.deploy.settings import RaySettings

    monkeypatch.setenv("TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS", "2")  # the scheduler process inherits it
    settings = RaySettings(base_model=tiny_model_dir, database_url=new_postgres_database("temper_ray"),
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
