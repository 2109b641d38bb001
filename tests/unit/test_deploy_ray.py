"""The Ray deployment's settings plumbing (deploy/), without Ray: what each worker actor is given."""

from __future__ import annotations

from pathlib import Path

from temper.deploy.ray_cluster import RayDeployment, runtime_env
from temper.deploy.settings import RaySettings


def test_workers_get_the_deployments_model_token_folders_and_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPER_TRAINER_MAX_RESIDENT_ADAPTERS", "7")  # the role's own variables pass through
    deployment = RayDeployment(RaySettings(base_model="/models/tiny", data_dir=tmp_path, trainer_cpus=2, sampler_gpus=1))
    trainer = deployment.worker_settings("trainer", 1, "10.0.0.1:50052")
    sampler = deployment.worker_settings("sampler", 0, "")
    for worker in (trainer, sampler):
        assert worker.base_model == "/models/tiny"
        assert worker.internal_token.get_secret_value() == deployment.token
    assert trainer.max_resident_adapters == 7 and trainer.num_threads == 2 and trainer.device == "cpu"
    assert trainer.checkpoint_dir == tmp_path / "checkpoints" and trainer.offload_dir == tmp_path / "trainer-1-offload"
    assert sampler.device == "cuda" and sampler.adapter_dir == tmp_path / "sampler-0-adapters"
    assert trainer.register_with == "10.0.0.1:50052" and sampler.register_with == ""


def test_a_trainer_actor_gets_the_tuned_allocator_through_its_runtime_env(tmp_path):
    deployment = RayDeployment(RaySettings(data_dir=tmp_path, internal_token="secret"))
    assert "MALLOC_TOP_PAD_" in runtime_env(deployment.worker_settings("trainer", 0, ""))["env_vars"]
    assert runtime_env(deployment.worker_settings("sampler", 0, "")) == {}
    assert deployment.token == "secret"


def test_the_default_database_is_sqlite_under_the_data_dir(tmp_path):
    assert RaySettings(data_dir=tmp_path).resolved_database_url() == f"sqlite:///{Path(tmp_path).resolve() / 'temper.db'}"
