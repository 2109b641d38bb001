"""The Ray deployment's settings plumbing (deploy/), without Ray: what each worker actor is given, and
what the model catalogue's layout makes of the trainers (groups) and samplers (tp/dp sizes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from temper.deploy.ray_cluster import (RayDeployment, Worker, check_layout, group_bundles, planned_registries, rank_settings,
                                       runtime_env)
from temper.deploy.settings import RaySettings
from temper.services.models.catalogue import DEFAULT_LAYOUT, Catalogue, ModelLayout


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


def test_a_rank_of_a_group_gets_this_process_catalogue_through_its_runtime_env(tmp_path):
    catalogue = '{"/models/tiny": {"ranks_per_trainer": 2}}'
    deployment = RayDeployment(RaySettings(base_model="/models/tiny", data_dir=tmp_path, internal_token="t"),
                               Catalogue.from_json(catalogue))
    trainer, environ = deployment.worker_settings("trainer", 0, ""), {"TEMPER_MODEL_CATALOGUE": catalogue}
    rank = runtime_env(rank_settings(trainer, 1, 2, "10.0.0.7:29511"), environ)["env_vars"]
    assert rank["TEMPER_MODEL_CATALOGUE"] == catalogue and "MALLOC_TOP_PAD_" in rank
    assert "TEMPER_MODEL_CATALOGUE" not in runtime_env(trainer, environ)["env_vars"]  # a lone trainer does not read it
    assert runtime_env(deployment.worker_settings("sampler", 0, ""), environ) == {}


def test_the_workers_start_beside_the_schedulers_when_every_registry_port_is_fixed():
    settings = RaySettings(scheduler_replicas=2, registry_port=50052)
    assert planned_registries(settings, "10.0.0.1") == ["10.0.0.1:50052", "10.0.0.1:50152"]
    assert planned_registries(settings.model_copy(update={"registry_host": "127.0.0.1"}), "10.0.0.1")[0] == "127.0.0.1:50052"
    assert planned_registries(settings.model_copy(update={"registry_port": 0}), "10.0.0.1") == []  # known once bound


def test_the_default_database_is_sqlite_under_the_data_dir(tmp_path):
    assert RaySettings(data_dir=tmp_path).resolved_database_url() == f"sqlite:///{Path(tmp_path).resolve() / 'temper.db'}"


# ---- layouts from the model catalogue (issue 20): trainer groups and sampler sizes ---------------------

CONFIG = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=96)


def test_a_group_is_a_bundle_per_rank_with_its_devices_when_trainers_use_gpus():
    layout = ModelLayout(ranks_per_trainer=4, devices_per_rank=2)
    assert group_bundles(layout, cpus=1, gpus=0) == [{"CPU": 1}] * 4
    assert group_bundles(layout, cpus=2, gpus=1) == [{"CPU": 2, "GPU": 2}] * 4


def test_each_rank_gets_its_rank_the_world_size_and_the_groups_rendezvous(tmp_path):
    deployment = RayDeployment(RaySettings(base_model="/models/tiny", data_dir=tmp_path, internal_token="t"),
                               Catalogue.from_json('{"/models/tiny": {"ranks_per_trainer": 2}}'))
    base = deployment.worker_settings("trainer", 0, "10.0.0.1:50052")
    ranks = [rank_settings(base, rank, 2, "10.0.0.7:29511") for rank in range(2)]
    assert [(r.rank, r.world_size, r.group_addr) for r in ranks] == [(0, 2, "10.0.0.7:29511"), (1, 2, "10.0.0.7:29511")]
    assert all(r.base_model == "/models/tiny" and r.register_with == "10.0.0.1:50052" for r in ranks)
    assert base.world_size == 1  # the shared settings are not changed


def test_the_samplers_get_the_layouts_tensor_and_data_parallel_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPER_MODEL_CATALOGUE", json.dumps({"org/big": {"ranks_per_trainer": 8, "sampler_tp_size": 4,
                                                                         "sampler_dp_size": 2}}))
    deployment = RayDeployment(RaySettings(base_model="org/big", data_dir=tmp_path, internal_token="t"))
    assert deployment.layout.ranks_per_trainer == 8
    sampler = deployment.worker_settings("sampler", 0, "")
    assert (sampler.tp_size, sampler.dp_size) == (4, 2)
    other = RayDeployment(RaySettings(base_model="org/small", data_dir=tmp_path, internal_token="t"))
    assert other.layout == DEFAULT_LAYOUT and other.worker_settings("sampler", 0, "").tp_size == 1


def test_a_layout_that_does_not_divide_the_model_is_refused_with_check_divides_message():
    catalogue = Catalogue.from_json('{"m": {"ranks_per_trainer": 2, "sampler_tp_size": 3}}')
    with pytest.raises(ValueError, match=r"m: 8 attention heads do not split over sampler_tp_size=3"):
        check_layout(catalogue, "m", lambda name: CONFIG)
    assert check_layout(Catalogue.from_json('{"m": {"sampler_tp_size": 4}}'), "m", lambda name: CONFIG).sampler_tp_size == 4
    assert check_layout(catalogue, "unlisted", lambda name: pytest.fail("an unlisted model is not loaded")) == DEFAULT_LAYOUT


def test_the_deployment_refuses_a_bad_layout_before_it_starts_ray(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2,
                                                   "hidden_size": 64, "intermediate_size": 96}))
    deployment = RayDeployment(RaySettings(base_model=str(model), data_dir=tmp_path, internal_token="t"),
                               Catalogue.from_json(json.dumps({str(model): {"ranks_per_trainer": 2, "sampler_tp_size": 16}})))
    with pytest.raises(ValueError, match="do not split over sampler_tp_size=16"):
        deployment.start()
    assert deployment._ray is None and deployment.scheduler is None


class FakeRay:
    """ray.wait / ray.kill / ray.get for restart_dead_groups: a rank's stopped() call is done when it is in ``done``."""

    def __init__(self):
        self.done, self.killed = set(), []

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r in self.done]
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    def kill(self, actor, no_restart=False):
        assert no_restart
        self.killed.append(actor)

    def get(self, value, timeout=None):
        return value


def test_a_group_one_rank_of_which_stopped_is_restarted_whole(tmp_path):
    deployment = RayDeployment(RaySettings(data_dir=tmp_path, internal_token="t"), Catalogue({}))
    deployment._ray = ray = FakeRay()
    started = []

    def start_group(worker):  # what _start_group does, minus Ray: new rank actors, their stopped() calls
        generation = len(started) + 1
        worker.ranks = [SimpleNamespace(address=SimpleNamespace(remote=lambda *a: "10.0.0.7:50061")) for _ in range(2)]
        worker.actor, worker.stops = worker.ranks[0], [f"g{generation}-rank{r}" for r in range(2)]
        started.append(worker.index)

    deployment._start_group = start_group
    for index in range(2):
        deployment.workers.append(Worker("trainer", index, None))
        start_group(deployment.workers[-1])
    first = list(deployment.workers[1].ranks)
    assert deployment.restart_dead_groups() == []  # every rank still up
    ray.done.add("g2-rank1")                       # rank 1 of trainer 1 stopped
    assert deployment.restart_dead_groups() == [1]
    assert ray.killed == first                     # both of its ranks, the live one too
    assert started == [0, 1, 1] and deployment.workers[1].address == "10.0.0.7:50061"
    assert deployment.restart_dead_groups() == []  # the new group's ranks are up


class ActorGone(Exception):
    pass


class ConnectedRay(FakeRay):
    """The ``ray`` module of a process that called ray.init already; a killed actor's calls raise ActorGone."""

    def __init__(self):
        super().__init__()
        self.shut_down = False
        self.util = SimpleNamespace(remove_placement_group=lambda group: None)

    def is_initialized(self):
        return True

    def init(self, **kwargs):
        pytest.fail("ray.init in a process already connected")

    def shutdown(self):
        self.shut_down = True

    def cluster_resources(self):
        return {"CPU": 2.0}

    def get_runtime_context(self):
        return SimpleNamespace(namespace="app")

    def get(self, value, timeout=None):
        if value in self.killed:
            raise ActorGone()
        return value


def test_a_deployment_in_a_process_connected_to_ray_uses_that_connection_and_leaves_it_up(tmp_path, monkeypatch):
    ray = ConnectedRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", SimpleNamespace(RayActorError=ActorGone))
    deployment = RayDeployment(RaySettings(data_dir=tmp_path, internal_token="t"), Catalogue({}))
    assert deployment._connect() is ray
    actor = SimpleNamespace()
    actor.pid = SimpleNamespace(remote=lambda: actor)  # the call's result is the actor itself: get() raises once killed
    deployment.workers.append(Worker("sampler", 0, actor))
    deployment.stop()
    assert ray.killed == [actor] and not ray.shut_down and deployment._ray is None and not deployment.workers
