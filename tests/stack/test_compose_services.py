"""docker-compose.yml's services, started from their compose commands and environments alone, work together.

There is no Docker engine here: each service of the file runs as a local process (compose_processes.py)
with its compose `command`, `environment` (after the image's ENV) and `depends_on` order, its host names
and ports mapped to free ports on 127.0.0.1, its volumes to folders, and `postgres` replaced by the test
database. A service is up when its own compose healthcheck passes. Then the unmodified tinker SDK trains
and samples through the gateway, first on the default services, then with the `sharded` profile brought
up as the file documents (`docker compose --profile sharded up --scale trainer=0`).

The model volume holds the tiny test model where `prepare-model` puts SmolLM2 (it finds it prepared), so
the services load the tiny model under the file's own base-model name through the shared model cache.
"""

from __future__ import annotations

import math
import re
import secrets
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tinker  # the `gateway` extra (make venv installs it): missing, the test fails, it is not skipped
from tinker import types as tt

from compose_model import REPO, as_env, documented_up, selected
from compose_processes import ComposeProject

TOKENS = [[5, 17, 42, 9, 77, 3, 18], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
ADAM = tt.AdamParams(learning_rate=1e-2, eps=1e-8)
PROVIDED = "postgres"  # the compose service the test's own database stands for


def seed_model_cache(project: ComposeProject, names: list[str], model_dir: str) -> None:
    """The tiny model, prepared, in each shared volume a service uses as its model cache (TEMPER_MODEL_CACHE,
    services/models/prepare.py), so `temper-prepare-model` finds it there and every model name resolves to it."""
    from temper.services.models.prepare import smollm2_dir

    volumes = project.root / "volumes"
    for name in names:
        cache = project.env(name).get("TEMPER_MODEL_CACHE")
        if cache and Path(cache).is_relative_to(volumes):
            shutil.copytree(model_dir, smollm2_dir(Path(cache)), dirs_exist_ok=True)


def listening(project: ComposeProject, name: str, field: str) -> str:
    """The local host:port of service ``name``'s setting ``field`` (BIND, METRICS_BIND: TEMPER_<PROCESS>_<FIELD>)."""
    env = project.env(name)
    return next(value for key, value in env.items() if re.fullmatch(rf"TEMPER_[A-Z]+_{field}", key))


def metric(project: ComposeProject, name: str, sample: str) -> float:
    """One sample's value on service ``name``'s /metrics (its *_METRICS_BIND)."""
    with urllib.request.urlopen(f"http://{listening(project, name, 'METRICS_BIND')}/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} serves no {sample}")


def sdk_datum(tokens: list[int]) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                    "weights": np.ones(len(tokens) - 1, np.float32)})


class DefaultServices:
    """The default services (`docker compose up`), brought up by the first test that needs them (inside the
    test: a service that does not come up fails it), with the SDK's ServiceClient on the gateway and one
    LoRA run trained a step."""

    def __init__(self, project: ComposeProject, database_url: str, model_dir: str):
        self.project, self.database_url, self.model_dir = project, database_url, model_dir
        self.client = None
        self.run = None
        # the base model the compose file's trainer serves, by the file's own name
        self.base_model = as_env(project.services["trainer"]["environment"])["TEMPER_TRAINER_BASE_MODEL"]

    def sdk(self):
        from temper.scheduler.admin import create_key

        if self.client is None:
            names = [name for name in selected(self.project.services, set()) if name != PROVIDED]
            seed_model_cache(self.project, names, self.model_dir)
            self.project.up(names)
            api_key = create_key(self.database_url, "compose", label="compose test")  # migrated by now
            self.client = tinker.ServiceClient(base_url=f"http://{listening(self.project, 'gateway', 'BIND')}", api_key=api_key)
        return self.client

    def trained(self) -> dict:
        """A LoRA run trained one step: its first loss (the base model's: LoRA starts at zero) and the one after."""
        if self.run is None:
            training = self.sdk().create_lora_training_client(self.base_model, rank=4, seed=0).result()
            data = [sdk_datum(t) for t in TOKENS]
            first = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
            training.optim_step(ADAM).result()
            after = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
            self.run = {"training": training, "first": first, "after": after}
        return self.run


@pytest.fixture(scope="module")
def database_url(new_postgres_database) -> str:
    """A fresh database of the test Postgres (fixtures_postgres.py): empty, as compose's `migrate` first finds it,
    and none of the session stack's (two sets of schedulers on one database would share lanes)."""
    return new_postgres_database("temper_compose")


@pytest.fixture(scope="module")
def project(database_url, tmp_path_factory):
    # the internal token as the file's header says to set it; nothing else comes from the test's shell
    environ = {"TEMPER_INTERNAL_TOKEN": secrets.token_urlsafe(32)}
    project = ComposeProject(REPO / "docker-compose.yml", tmp_path_factory.mktemp("compose"), environ, {PROVIDED: database_url})
    try:
        yield project
    finally:
        leaked = project.down()
        assert not leaked, f"process groups still alive after SIGKILL: {leaked}"


@pytest.fixture(scope="module")
def defaults(project, database_url, tiny_model_dir):
    services = DefaultServices(project, database_url, tiny_model_dir)
    yield services
    if services.client is not None:
        services.client.close("success")


def test_default_services_train_save_and_sample(defaults):
    run = defaults.trained()
    assert math.isfinite(run["first"]) and run["after"] < run["first"]  # the step moved the adapter
    training, sdk = run["training"], defaults.sdk()
    path = training.save_weights_for_sampler("compose").result().path
    assert path == f"tinker://{training.model_id}/sampler_weights/compose"
    sampler = sdk.create_sampling_client(model_path=path).result()
    assert sampler.get_base_model() == defaults.base_model
    got = sampler.sample(tt.ModelInput.from_ints(TOKENS[0]), num_samples=2,
                         sampling_params=tt.SamplingParams(max_tokens=4, temperature=0.7, seed=1, stop=[])).result()
    assert [len(s.tokens) for s in got.sequences] == [4, 4]
    assert all(math.isfinite(lp) and lp <= 0 for s in got.sequences for lp in s.logprobs)


def test_sharded_profile_trains_through_the_group(project, defaults):
    base = defaults.trained()  # on the default services first (brought up here if the test before did not)
    scaled_to_zero = documented_up(project.text, "sharded")  # the file's own command: --scale trainer=0
    assert scaled_to_zero, "docker-compose.yml documents how to run the sharded profile"
    for name in scaled_to_zero & project.running.keys():
        project.stop(name)
    names = [name for name in selected(project.services, {"sharded"}, scaled_to_zero) if name != PROVIDED]
    assert {"trainer-sharded", "trainer-sharded-rank1"} <= set(names)
    project.up(names)

    training = defaults.sdk().create_lora_training_client(defaults.base_model, rank=4, seed=0).result()
    data = [sdk_datum(t) for t in TOKENS]
    first = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(ADAM).result()
    # the base model's loss again, its weights sharded over two ranks now
    assert first == pytest.approx(base["first"], rel=1e-5)
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] < first
    assert metric(project, "trainer-sharded", "temper_trainer_optim_steps_total") >= 1
