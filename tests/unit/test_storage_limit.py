"""Limits hold exactly (issue 21, edge 7): a named save that would take its tenant's checkpoints over
max_storage_bytes is refused RESOURCE_EXHAUSTED before anything is written, measured by the trainer;
concurrent saves of a tenant cannot together cross it; an overwrite counts the bytes it frees."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pytest

from fakes_scheduler import FakeStore, FakeTrainer, build
from temper.common.errors import AlreadyExists, NotFound, ResourceExhausted
from temper.scheduler.db import models as m
from temper.scheduler.planning.work import Work, WorkKind
from temper.v1 import service_pb2, trainer_pb2, types_pb2

SIZE = 46_000  # what the trainer writes for one training checkpoint of these runs


@dataclass
class SavingTrainer(FakeTrainer):
    """Saves as the real trainer does: measure_only answers the bytes and writes nothing."""

    written: dict[str, int] = field(default_factory=dict)  # checkpoint key -> bytes

    async def call(self, method, request):
        if method != "SaveAdapter":
            return await super().call(method, request)
        await asyncio.sleep(0)  # another save may run meanwhile
        if request.measure_only:
            return trainer_pb2.SaveAdapterResponse(size_bytes=SIZE)
        if request.checkpoint_key in self.written:
            raise AlreadyExists(f"checkpoint {request.checkpoint_key} already exists")
        self.written[request.checkpoint_key] = SIZE
        return trainer_pb2.SaveAdapterResponse(size_bytes=SIZE)

    async def delete_checkpoint(self, key):
        return self.written.pop(key, 0)


class StorageStore(FakeStore):
    def __init__(self):
        super().__init__()
        self.checkpoints: dict[str, m.Checkpoint] = {}

    def storage_bytes(self, tenant):
        return sum(c.size_bytes for c in self.checkpoints.values() if self.tenants[c.training_run_id] == tenant)

    def get_checkpoint(self, path):
        if path not in self.checkpoints:
            raise NotFound(f"checkpoint {path} not found")
        return self.checkpoints[path]

    def delete_checkpoint_row(self, checkpoint_id, actor=None, reason=""):
        self.checkpoints = {p: c for p, c in self.checkpoints.items() if c.id != checkpoint_id}

    def add_or_get_checkpoint(self, run_id, kind, name, path, size, ephemeral, ttl_seconds, user_metadata, actor=None):
        row = m.Checkpoint(id=len(self.checkpoints) + 1, training_run_id=run_id, kind=kind, name=name, path=path,
                           size_bytes=size, created_at=datetime.now(timezone.utc), published=False, ephemeral=ephemeral)
        return self.checkpoints.setdefault(path, row)


def scheduler(limit: int, runs=("a", "b")):
    store = StorageStore()
    for run in runs:
        store.add_run(run, "alice")
    store.limits["alice"] = {"max_storage_bytes": limit}
    s = build(store=store, trainer=SavingTrainer())

    async def forget_checkpoint(key):  # no sampler holds it here
        return None

    s.loop.backends.forget_checkpoint = forget_checkpoint
    return s


async def save(s, run_id: str, name: str, overwrite: bool = False):
    await s.admission.quotas.limits("alice")  # as admission reads them (not_taken) before the save runs
    await s.loop.runs.get(run_id)
    request = service_pb2.SaveWeightsRequest(training_run_id=run_id, seq_id=1, name=name, overwrite=overwrite,
                                             kind=types_pb2.CHECKPOINT_KIND_TRAINING)
    return await s.loop._save(s.trainer, Work(run_id, 1, WorkKind.SAVE_WEIGHTS, request, tenant="alice"), False)


@pytest.mark.parametrize("limit", [1, SIZE - 1])
def test_a_save_that_would_cross_the_limit_is_refused_and_nothing_is_written(limit):
    s = scheduler(limit)
    with pytest.raises(ResourceExhausted, match=f"max_storage_bytes = {limit} reached \\(in use: 0\\)"):
        asyncio.run(save(s, "a", "w"))
    assert s.trainer.written == {} and s.store.checkpoints == {}


def test_saves_fill_the_limit_exactly_and_concurrent_ones_do_not_cross_it():
    s = scheduler(2 * SIZE)

    async def main():
        return await asyncio.gather(*(save(s, run, name) for run in ("a", "b") for name in ("x", "y")), return_exceptions=True)

    outcomes = asyncio.run(main())
    assert sum(isinstance(o, ResourceExhausted) for o in outcomes) == 2
    assert len(s.trainer.written) == len(s.store.checkpoints) == 2 and s.store.storage_bytes("alice") == 2 * SIZE


def test_an_overwrite_counts_the_bytes_it_frees():
    s = scheduler(SIZE)
    asyncio.run(save(s, "a", "w"))
    asyncio.run(save(s, "a", "w", overwrite=True))  # at the limit, but it replaces a checkpoint of the same size
    assert list(s.store.checkpoints) == ["tinker://a/weights/w"] and s.store.storage_bytes("alice") == SIZE
    with pytest.raises(ResourceExhausted):
        asyncio.run(save(s, "b", "w"))
    assert list(s.trainer.written) == ["a/weights/w"]


def test_no_limit_no_measuring():
    s = scheduler(0)
    measured = []
    call = s.trainer.call
    s.trainer.call = lambda method, request: measured.append(request.measure_only) or call(method, request)
    asyncio.run(save(s, "a", "w"))
    assert measured == [False] and s.store.storage_bytes("alice") == SIZE
