"""Withdrawn access ends (issue 21, edge 4): once a checkpoint is unpublished, deleted or expired, the
sampling clients made on it answer NOT_FOUND on their next call, another tenant's and the owner's,
though a sampler still holds the adapter. The real Store on SQLite; samplers faked."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from types import SimpleNamespace

import pytest

from temper.common.errors import NotFound
from temper.scheduler.api.sampling_verbs import SamplingVerbs
from temper.scheduler.db import models as m
from temper.scheduler.db.access import ReadAccess, ReadFacts
from temper.scheduler.db.outage import now
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.v1 import sampler_pb2, service_pb2, types_pb2

PROMPT = types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=b"\x01\x00\x00\x00" * 3))])


class Verbs(SamplingVerbs):
    """The sampling verbs over the real store; every sampler holds every adapter (no push needed)."""

    def __init__(self, store: Store):
        self.store, self.calls = store, []
        info = sampler_pb2.SamplerModelInfo(base_model="b", vocab_size=100, max_context_length=64)

        async def call_samplers(base_model, method, request, load=None):
            self.calls.append(method)
            return types_pb2.SampleResponse() if method == "Sample" else sampler_pb2.ComputeLogprobsResponseInternal()

        async def nothing(*args):
            return None

        self.backends = SimpleNamespace(wait_ready=nothing, served=nothing, sampler_info=lambda base: info,
                                        holds=lambda base, key: True, call_samplers=call_samplers)
        self.admission = SimpleNamespace(quotas=SimpleNamespace(wait_to_sample=nothing, sampled=SimpleNamespace(record=lambda t, n: None)))
        self._closed_sessions = set()
        self._init_sampling()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One database for the module (migrating takes seconds); each test makes its own checkpoints."""
    url = f"sqlite:///{tmp_path_factory.mktemp('withdrawn') / 'temper.db'}"
    upgrade_schema(url)
    return Store(url)


def checkpoint_of(store: Store, tenant: str) -> str:
    session = store.create_session(tenant, [], {})
    run_id = store.next_run_id(session.id)
    store.add_training_run(m.TrainingRun(id=run_id, session_id=session.id, base_model="b", lora_rank=4, lora_alpha=8.0,
                                         train_attn=True, train_mlp=True, train_unembed=False))
    return store.add_checkpoint(run_id, "sampler", "w", f"tinker://{run_id}/sampler_weights/w", 10).path


def sampling_client(store: Store, tenant: str, path: str) -> str:
    return store.add_sampling_client(store.create_session(tenant, [], {}).id, "b", path).id


def call(verbs: Verbs, tenant: str, sampler_id: str, method: str = "Sample"):
    token = set_caller(tenant)
    try:
        if method == "Sample":
            return asyncio.run(verbs.Sample(service_pb2.SampleRequest(
                sampler_id=sampler_id, prompt=PROMPT, num_samples=1, sampling_params=types_pb2.SamplingParams(max_tokens=4)), None))
        return asyncio.run(verbs.ComputeLogprobs(service_pb2.ComputeLogprobsRequest(sampler_id=sampler_id, prompt=PROMPT), None))
    finally:
        reset_caller(token)


def unpublish(store, path):
    store.update_checkpoint(path, "alice", False, False)


def delete(store, path):
    store.delete_checkpoint_row(store.get_checkpoint(path).id)


def expire(store, path):
    store.update_checkpoint(path, "alice", None, now() + timedelta(hours=1))
    return True  # expires later: the check below moves the clock past it


@pytest.mark.parametrize("method", ["Sample", "ComputeLogprobs"])
@pytest.mark.parametrize("withdraw, reader", [(unpublish, "bob"), (delete, "bob"), (delete, "alice"), (expire, "bob"),
                                              (expire, "alice")])
def test_a_withdrawn_checkpoint_ends_its_sampling_clients(store, withdraw, reader, method, monkeypatch):
    path = checkpoint_of(store, "alice")
    store.update_checkpoint(path, "alice", True, False)
    verbs = Verbs(store)
    sampler = sampling_client(store, reader, path)
    call(verbs, reader, sampler, method)
    call(verbs, reader, sampler, method)  # remembered: the decision is made from memory
    assert verbs.calls == [method, method]
    if withdraw(store, path):
        call(verbs, reader, sampler, method)  # not expired yet
        monkeypatch.setattr(store.read_access, "clock", lambda: now() + timedelta(hours=2))
    with pytest.raises(NotFound, match="not found"):
        call(verbs, reader, sampler, method)
    assert verbs.calls.count(method) == (3 if withdraw is expire else 2)  # the refused call reached no sampler


def test_a_remembered_decision_takes_no_query(store, monkeypatch):
    path = checkpoint_of(store, "alice")
    store.update_checkpoint(path, "alice", True, False)
    store.read_access.forget(path)  # nothing remembered: the first call asks the database
    verbs, queries = Verbs(store), []
    read = store.readable_checkpoint
    monkeypatch.setattr(store, "readable_checkpoint", lambda *args: queries.append(args) or read(*args))
    sampler = sampling_client(store, "bob", path)
    for _ in range(3):
        call(verbs, "bob", sampler)
    assert queries == [(path, "bob")] and verbs.calls == ["Sample"] * 3


def test_a_read_that_raced_a_change_is_not_remembered():
    access = ReadAccess(now)
    generation = access.generation()  # a read starts, sees the checkpoint published ...
    access.forget("p")                # ... an unpublish commits meanwhile ...
    access.remember("p", ReadFacts("alice", True, None), generation)  # ... and the stale read lands
    assert access.may_read("p", "bob") is None  # asked again, not answered from the stale read
    access.remember("p", ReadFacts("alice", False, None), access.generation())
    assert access.may_read("p", "bob") is False and access.may_read("p", "alice") is True
