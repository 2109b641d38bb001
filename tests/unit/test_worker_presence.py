"""A model with no worker here now answers as transient when it is this deployment's
(scheduler/workers/presence.py): a scheduler that has just restarted and is still learning its
workers, a model with trainers and no sampler yet, or one the database names, waits for its
workers a bounded time and then answers UNAVAILABLE (which clients retry), never NOT_FOUND; a
model unknown here answers NOT_FOUND. Against fake sampler stubs (test_backends_adapters)."""

from __future__ import annotations

import asyncio

import pytest

from temper.common.errors import NotFound, Unavailable
from temper.scheduler.db import models as m
from temper.scheduler.db.named_models import named_base_models
from temper.scheduler.db.store import Store
from temper.scheduler.workers.backends import Backends, TrainerHandle
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import sampler_pb2, trainer_pb2
from test_backends_adapters import sampler

WAIT = 0.3  # worker_timeout_seconds: the learning window and the longest wait for an absent model's workers


def registry_backends(**overrides) -> Backends:
    fields = dict(database_url="sqlite://", bind="127.0.0.1:0", registry_bind="127.0.0.1:0", worker_timeout_seconds=WAIT,
                  sampler_retry_seconds=0)
    settings = SchedulerSettings(**{**fields, **overrides})
    return Backends(settings)


def trainer(model: str = "m", address: str = "trainer:1") -> TrainerHandle:
    return TrainerHandle(address, None, trainer_pb2.ModelInfo(base_model=model, incarnation="t1"), None)


async def past_learning(b: Backends) -> None:
    await asyncio.sleep(WAIT)  # the learning window is WAIT from the Backends' start


def base_sample(b: Backends):
    return b.call_samplers("m", "Sample", sampler_pb2.SamplerSampleRequest())


def test_the_restart_window_waits_for_the_sampler_instead_of_not_found():
    """The issue's window: the trainers registered, the sampler's next heartbeat has not come yet."""

    async def scenario():
        b = registry_backends(worker_timeout_seconds=30.0)  # still learning for the whole test
        b.add_trainer(trainer())
        call = asyncio.create_task(base_sample(b))
        await asyncio.sleep(0.05)
        assert not call.done()  # waiting, not answered NOT_FOUND
        b.add_sampler(sampler("sampler:1", settings=b.settings))  # the sampler registers again
        response = await asyncio.wait_for(call, 5.0)
        assert response.sequences[0].tokens.decode() == "sampler:1"

    asyncio.run(scenario())


def test_a_model_with_trainers_and_no_sampler_yet_answers_unavailable_after_the_wait():
    async def scenario():
        b = registry_backends()
        b.add_trainer(trainer())
        await past_learning(b)
        with pytest.raises(Unavailable, match="no sampler of base model 'm'"):
            await base_sample(b)
        with pytest.raises(Unavailable):
            b.sampler_info("m")  # the synchronous lookups answer as transient too
        with pytest.raises(Unavailable):
            await b.served("sampler", "m")

    asyncio.run(scenario())


def test_a_model_with_samplers_and_no_trainer_now_answers_unavailable():
    async def scenario():
        b = registry_backends()
        b.add_sampler(sampler("sampler:1", settings=b.settings))
        await past_learning(b)
        with pytest.raises(Unavailable, match="no trainer of base model 'm'"):
            b.trainer_for("m", "run")
        with pytest.raises(Unavailable):
            b.place("m")
        with pytest.raises(Unavailable):
            await b.served("trainer", "m")

    asyncio.run(scenario())


def test_a_model_the_database_names_is_transient_and_an_unknown_one_not_found_once_learned():
    async def scenario():
        b = registry_backends()
        b.known_models.add("from-before")  # runs or sampling clients made before the restart
        b.add_trainer(trainer())
        waiting = asyncio.create_task(b.served("sampler", "unknown"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # learning: every model may still come
        with pytest.raises(NotFound, match="no sampler serves base model 'unknown'"):
            await asyncio.wait_for(waiting, 5.0)  # answered when the learning window ends
        assert not b.learning()
        with pytest.raises(NotFound, match="no trainer serves base model 'unknown'"):
            b.trainer_for("unknown", "run")
        with pytest.raises(Unavailable):
            b.trainer_for("from-before", "run")
        with pytest.raises(Unavailable):
            b.sampler_for("from-before")

    asyncio.run(scenario())


def test_without_a_registry_every_worker_answered_before_serving_so_a_missing_model_is_not_found():
    async def scenario():
        b = Backends(SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0", sampler_retry_seconds=0))
        b.add_trainer(trainer())
        assert not b.learning()
        with pytest.raises(NotFound, match="no sampler serves base model 'm'"):
            await base_sample(b)
        with pytest.raises(NotFound):
            b.sampler_info("m")

    asyncio.run(scenario())


def test_the_database_names_the_models_of_runs_and_sampling_clients(tmp_path):
    """What app.py puts in known_models at start (with a registry)."""
    store = Store(f"sqlite:///{tmp_path / 'temper.db'}")
    m.Base.metadata.create_all(store.engine)  # the tables as the models declare them (quicker than the migrations)
    assert named_base_models(store) == set()
    session = store.create_session("alice", [], {})
    store.add_training_run(m.TrainingRun(id=f"{session.id}:train:0", session_id=session.id, base_model="trained",
                                         lora_rank=4, lora_alpha=8.0, train_attn=True, train_mlp=True, train_unembed=False))
    store.add_sampling_client(session.id, "sampled", None)
    store.add_sampling_client(session.id, "trained", None)
    assert named_base_models(store) == {"trained", "sampled"}


def test_the_model_list_waits_out_the_restart_window_instead_of_listing_a_partial_set():
    """Issue 21's remainder of edge 1: GetServerCapabilities after a restart listed only the models whose
    workers had registered again (a model missing, or trainable and not yet sampleable)."""

    async def scenario():
        b = registry_backends(worker_timeout_seconds=30.0)
        b.known_models = {"m", "other"}  # the database names both (runs and sampling clients before the restart)
        b.add_trainer(trainer("m"))
        listing = asyncio.create_task(b.settled())
        await asyncio.sleep(0.05)
        assert not listing.done()  # "m" has no sampler yet and "other" nothing
        b.add_sampler(sampler("sampler:1", settings=b.settings))  # serves "m"
        await asyncio.sleep(0.05)
        assert not listing.done()
        b.add_trainer(trainer("other", "trainer:2"))
        other = sampler("sampler:2", settings=b.settings)
        other.info.base_model = "other"
        b.add_sampler(other)
        await asyncio.wait_for(listing, 5.0)
        assert sorted(b.model_names()) == ["m", "other"]

    asyncio.run(scenario())


def test_the_model_list_waits_no_longer_than_the_learning_window():
    async def scenario():
        b = registry_backends()  # WAIT seconds of learning
        b.known_models = {"gone"}  # named by the database, its workers never come back
        await asyncio.wait_for(b.settled(), WAIT + 5.0)
        assert not b.learning()

    asyncio.run(scenario())
