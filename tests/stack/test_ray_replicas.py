"""Two scheduler replicas under the Ray deployment (TEMPER_RAY_SCHEDULER_REPLICAS=2; deploy/schedulers.py),
on Postgres, with a trainer and a sampler as Ray actors that register with both replicas' registries.
A run trains and samples through the comma-separated address; the replica holding the run's lane is
killed (SIGKILL); the run's calls still succeed through the other (the client retries, the survivor
takes the lane), its step count exact; the supervisor starts the killed replica again on its ports and
the workers register with it again. SQLite with two replicas is refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from fixtures_stack import sft_datum
from replica_fixtures import lane_holders, replica_addresses
from test_faults import metric, wait_until
from ray_fixtures import free_port
from test_trainer_loss import ADAM, DATA


def knows_workers(service) -> bool:
    """Whether this scheduler replica counts the deployment's one trainer and one sampler."""
    try:
        return all(metric(service, f'temper_scheduler_workers{{role="{role}"}}') == 1 for role in ("trainer", "sampler"))
    except (OSError, AssertionError):  # not serving metrics yet (starting again)
        return False


@pytest.mark.timeout(420)
def test_two_replicas_on_ray_serve_a_run_and_one_killed_loses_no_call(tiny_model_dir, new_postgres_database, tmp_path,
                                                                      monkeypatch):
    from temper.client import ModelInput, SamplingParams, ServiceClient
    from temper.deploy.__main__ import supervise
    from temper.deploy.ray_cluster import LOOPBACK_ONLY, RayDeployment
    from temper.deploy.settings import RaySettings

    monkeypatch.setenv(LOOPBACK_ONLY, "0")
    monkeypatch.setenv("TEMPER_SCHEDULER_LEASE_SECONDS", "2")  # the scheduler processes inherit these
    monkeypatch.setenv("TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS", "2")
    monkeypatch.setenv("TEMPER_TRAINER_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("TEMPER_SAMPLER_HEARTBEAT_SECONDS", "0.5")
    url = new_postgres_database("temper_ray_replicas")
    settings = RaySettings(num_cpus=2, base_model=tiny_model_dir, database_url=url, data_dir=tmp_path / "ray",
                           scheduler_bind="127.0.0.1:0", scheduler_replicas=2, trainer_port=free_port(),
                           sampler_port=free_port(), registry_host="127.0.0.1", registry_port=0, ready_timeout_seconds=240)
    stop = threading.Event()
    with RayDeployment(settings) as deployment:
        address = deployment.start()
        replicas = deployment.scheduler.services_of("scheduler")
        assert [s.name for s in replicas] == ["scheduler", "scheduler-1"]
        assert address == ",".join(f"127.0.0.1:{s.port}" for s in replicas) and replicas[0].port != replicas[1].port
        registries = deployment.scheduler.registries()
        assert len(set(registries)) == 2
        assert all(w.actor is not None for w in deployment.workers)
        for replica in replicas:  # each worker registered with both replicas' registries
            assert replica.env["TEMPER_SCHEDULER_REPLICAS"] == "true"
            wait_until(lambda: knows_workers(replica), 120, f"{replica.name} knowing both workers")
        supervisor = threading.Thread(target=supervise, args=(deployment, stop, 0.5), daemon=True)
        supervisor.start()
        try:
            with ServiceClient(address, api_key=deployment.scheduler.key_for("local")) as client:
                run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
                for tokens in DATA[:3]:
                    run.forward_backward([sft_datum(tokens)]).result(timeout=120)
                    run.optim_step(ADAM).result(timeout=120)
                sampler = run.save_weights_and_get_sampling_client("before")
                out = sampler.sample(ModelInput.from_ints(DATA[0][:4]), num_samples=1,
                                     sampling_params=SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=120)
                assert len(out.sequences[0].tokens) == 4

                # SIGKILL the replica holding the trainer's lane, with the run's next calls in flight
                trainer = deployment.of("trainer")[0].address
                wait_until(lambda: trainer in lane_holders(url), 60, "the trainer's lane held")
                holder = replica_addresses(url)[lane_holders(url)[trainer][0]]
                victim = next(s for s in replicas if s.port == int(holder.rsplit(":", 1)[1]))
                survivor = next(s for s in replicas if s is not victim)
                killed_pid = victim.process.pid
                pending = [f for tokens in DATA[3:] for f in (run.forward_backward([sft_datum(tokens)]), run.optim_step(ADAM))]
                os.kill(killed_pid, signal.SIGKILL)
                outputs = [f.result(timeout=240) for f in pending]  # every call succeeds, through the survivor
                assert outputs[-1].metrics["step:max"] == len(DATA)  # none lost, none applied twice
                sampler = run.save_weights_and_get_sampling_client("after")
                out = sampler.sample(ModelInput.from_ints(DATA[0][:4]), num_samples=1,
                                     sampling_params=SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=120)
                assert len(out.sequences[0].tokens) == 4
                assert survivor.process.poll() is None

                # the supervisor starts the killed replica again, on its ports; the workers register with it again
                def restarted():
                    current = deployment.scheduler.service(victim.name)
                    return current.process.pid != killed_pid and current.port == victim.port

                wait_until(restarted, 120, f"{victim.name} started again on port {victim.port}")
                again = deployment.scheduler.service(victim.name)
                assert again.registry_port == victim.registry_port
                wait_until(lambda: knows_workers(again), 120, f"{victim.name} knowing both workers again")
        finally:
            stop.set()
            supervisor.join(timeout=30)


def test_two_replicas_on_sqlite_are_refused_before_anything_starts(tmp_path):
    env = {**os.environ, "TEMPER_RAY_SCHEDULER_REPLICAS": "2", "TEMPER_RAY_DATA_DIR": str(tmp_path)}
    env.pop("TEMPER_RAY_DATABASE_URL", None)
    done = subprocess.run([sys.executable, "-m", "temper.deploy"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "temper deploy: scheduler_replicas=2 needs a PostgreSQL database_url" in done.stderr
    assert "got sqlite" in done.stderr and not (tmp_path / "temper.db").exists()


def test_each_replica_gets_its_own_ports_clear_of_the_other_defaults():
    from temper.deploy.schedulers import nth
    from temper.deploy.settings import RaySettings

    s = RaySettings()
    api = [nth(s.scheduler_bind, i) for i in range(3)]
    registries = [nth(f"10.0.0.1:{s.registry_port}", i) for i in range(3)]
    assert api == ["127.0.0.1:50051", "127.0.0.1:50151", "127.0.0.1:50251"]
    assert registries == ["10.0.0.1:50052", "10.0.0.1:50152", "10.0.0.1:50252"]
    workers = {s.trainer_port + i for i in range(8)} | {s.sampler_port + i for i in range(8)}
    ports = [int(a.rsplit(":", 1)[1]) for a in api + registries]
    assert len(set(ports)) == len(ports) and not set(ports) & workers
    assert nth("0.0.0.0:0", 2) == "0.0.0.0:0"  # a free port for each
