"""A trainer group from the model catalogue on Ray (deploy/ray_cluster.py): the catalogue gives the tiny
model 2 ranks per trainer, so the deployment starts its trainer as a 2-rank group in one STRICT_PACK
placement group (a CPU bundle per rank). One rank's process is killed (SIGKILL): the supervisor starts
both ranks again (new pids), rank 0 at the same address, and the scheduler restores the run, which
goes on with its step count exact. Each killed rank is a case; both use the one deployment the module
starts (on its own Ray cluster, ray_fixtures.py), each with a run of its own."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from fixtures_stack import sft_datum
from ray_fixtures import free_port, ray_cluster
from test_faults import metric
from test_trainer_loss import ADAM, DATA


def runs_restored(deployment) -> float:
    try:
        return metric(deployment.scheduler.service("scheduler"), 'temper_scheduler_runs_restored_total{outcome="restored"}')
    except AssertionError:  # none yet: the series appears with the first restore
        return 0.0


@pytest.fixture(scope="module")
def group_deployment(tiny_model_dir, new_postgres_database, tmp_path_factory):
    """The deployment (a 2-rank trainer group and a sampler: 3 CPUs) and its supervisor, polling every 0.5 s."""
    from temper.deploy.__main__ import supervise
    from temper.deploy.ray_cluster import RayDeployment
    from temper.deploy.settings import RaySettings

    with pytest.MonkeyPatch.context() as env:  # read again when the supervisor starts the group again
        env.setenv("TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS", "2")
        env.setenv("TEMPER_TRAINER_GROUP_TIMEOUT_SECONDS", "8")
        env.setenv("TEMPER_MODEL_CATALOGUE", json.dumps({tiny_model_dir: {"ranks_per_trainer": 2}}))
        with ray_cluster(num_cpus=3):
            settings = RaySettings(base_model=tiny_model_dir, database_url=new_postgres_database("temper_ray_group"),
                                   data_dir=tmp_path_factory.mktemp("ray"), scheduler_bind="127.0.0.1:0",
                                   trainer_port=free_port(), sampler_port=free_port(), registry_host="127.0.0.1",
                                   registry_port=free_port(), ready_timeout_seconds=120)
            stop = threading.Event()
            with RayDeployment(settings) as deployment:
                address = deployment.start()
                supervisor = threading.Thread(target=supervise, args=(deployment, stop, 0.5), daemon=True)
                supervisor.start()
                try:
                    yield deployment, address
                finally:
                    stop.set()
                    supervisor.join(timeout=30)


def group_restarted(deployment, before: list[int], timeout: float = 60.0) -> list[int]:
    """The group's new pids, once none of ``before`` is among them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            after = deployment.group_pids()
        except Exception:  # a rank of the old group, or one not started yet
            after = before
        if not set(after) & set(before):
            return after
        assert time.monotonic() < deadline, f"the group was not restarted as a unit: pids {before} -> {after}"
        time.sleep(0.3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_trainer_group_from_the_catalogue_is_restarted_as_a_unit(killed, group_deployment, tiny_model_dir):
    from temper.client import ServiceClient

    deployment, address = group_deployment
    group = deployment.of("trainer")[0]
    assert len(group.ranks) == 2 and deployment._ray.util.placement_group_table(group.group)["strategy"] == "STRICT_PACK"
    trainer, before = group.address, deployment.group_pids()
    with ServiceClient(address, api_key=deployment.scheduler.key_for("local")) as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
        for tokens in DATA[:3]:
            run.forward_backward([sft_datum(tokens)]).result(timeout=60)
            run.optim_step(ADAM).result(timeout=60)
        restored = runs_restored(deployment)  # the cases share the scheduler

        os.kill(before[killed], signal.SIGKILL)
        group_restarted(deployment, before)
        assert deployment.wait_serving("trainer") == trainer  # the same bundles, the same port

        pending = [f for tokens in DATA[3:] for f in (run.forward_backward([sft_datum(tokens)]), run.optim_step(ADAM))]
        outputs = [f.result(timeout=90) for f in pending]
        assert outputs[-1].metrics["step:max"] == len(DATA)
        assert runs_restored(deployment) >= restored + 1
