"""scheduler/workers/backends.py::TrainerHandle.snapshot / restore: the SnapshotAdapter and RestoreAdapter
calls to a trainer (fake stub), with the trainer-call deadline, their answers and their errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from temper.common.errors import FailedPrecondition
from temper.scheduler.workers.backends import TrainerHandle
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import trainer_pb2

SETTINGS = SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0")


class Stub:
    def __init__(self):
        self.calls = []

    async def SnapshotAdapter(self, request, timeout=None):
        assert isinstance(request, trainer_pb2.SnapshotAdapterRequest)
        self.calls.append(("snapshot", request.training_run_id, request.checkpoint_key, timeout))
        return trainer_pb2.SnapshotAdapterResponse(size_bytes=1234, applied_seq_id=7, steps=3)

    async def RestoreAdapter(self, request, timeout=None):
        assert isinstance(request, trainer_pb2.RestoreAdapterRequest)
        self.calls.append(("restore", request.training_run_id, request.checkpoint_key, timeout))
        if request.training_run_id != "run-1":
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "snapshot run-1/snapshots/s cannot be restored on this trainer: it holds run 'run-1'")
        return trainer_pb2.RestoreAdapterResponse(applied_seq_id=7, steps=3)


def test_snapshot_and_restore_call_the_trainer():
    stub = Stub()
    handle = TrainerHandle("fake-trainer:1", stub, trainer_pb2.ModelInfo(base_model="m"), SETTINGS)
    snap = asyncio.run(handle.snapshot("run-1", "run-1/snapshots/s"))
    assert (snap.size_bytes, snap.applied_seq_id, snap.steps) == (1234, 7, 3)
    restored = asyncio.run(handle.restore("run-1", "run-1/snapshots/s"))
    assert (restored.applied_seq_id, restored.steps) == (7, 3)
    timeout = SETTINGS.trainer_call_timeout_seconds
    assert stub.calls == [("snapshot", "run-1", "run-1/snapshots/s", timeout), ("restore", "run-1", "run-1/snapshots/s", timeout)]
    with pytest.raises(FailedPrecondition, match="holds run 'run-1'"):
        asyncio.run(handle.restore("run-2", "run-1/snapshots/s"))
