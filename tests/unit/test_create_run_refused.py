"""CreateTrainingRun refused or failed after its run number was reserved (scheduler/api/servicer.py): the
trainer keeps no adapter or snapshot of it, no row is added, and the session's run counter is as it
was; a number whose adapter could not be dropped stays skipped (a later run of it would meet it)."""

import asyncio

import pytest

from fakes_scheduler import MODEL, CreatingStore, FakeBackends, FakeTrainer, build
from temper.common.errors import InvalidArgument, Unavailable
from temper.scheduler.api.servicer import TemperServicer
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.v1 import service_pb2, types_pb2


class RefusingTrainer(FakeTrainer):
    """``fail``: "create" refuses CreateAdapter, "snapshot" the first snapshot; ``drop_down``: DropAdapter unanswered."""

    def __init__(self, fail: str = "", drop_down: bool = False):
        super().__init__(adapters={})
        self.fail, self.drop_down = fail, drop_down

    async def call(self, method, request):
        if method == "CreateAdapter" and self.fail == "create":
            raise InvalidArgument("LoRA rank too large for this trainer's memory")
        if method == "DropAdapter" and self.drop_down:
            raise Unavailable("DropAdapter: connection reset")
        return await super().call(method, request)

    async def snapshot(self, run_id, key):
        answer = await super().snapshot(run_id, key)  # written, then the answer is lost
        if self.fail == "snapshot":
            raise Unavailable("SnapshotAdapter: connection reset")
        return answer


def create(store: CreatingStore, trainer: FakeTrainer, **request):
    async def main():
        s = build(store=store, trainer=trainer)
        api = TemperServicer(s.store, FakeBackends(s.trainer), s.admission.runs, s.admission)
        token = set_caller("alice")
        try:
            return await api.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
                session_id="s", base_model=MODEL, lora_config=types_pb2.LoraConfig(rank=4, train_attn=True), **request), None)
        finally:
            reset_caller(token)

    return asyncio.run(main())


@pytest.mark.parametrize("fail", ["create", "snapshot", "database"])
@pytest.mark.parametrize("index", [None, 5])
def test_a_failed_creation_leaves_no_adapter_snapshot_row_or_run_number(fail, index):
    store, trainer = CreatingStore(fail_add=fail == "database"), RefusingTrainer(fail if fail != "database" else "")
    with pytest.raises(InvalidArgument if fail == "create" else Unavailable):
        create(store, trainer, **({"run_index": index} if index is not None else {}))
    assert trainer.adapters == {} and trainer.store == {} and store.runs == {}
    assert store.next_run == 0  # as before the call, also when it asked for a number ahead
    store.fail_add = False
    assert create(store, RefusingTrainer()).training_run_id == "s:train:0"  # the number given back is used


def test_a_number_whose_adapter_could_not_be_dropped_stays_skipped():
    store, trainer = CreatingStore(), RefusingTrainer("snapshot", drop_down=True)
    with pytest.raises(Unavailable):
        create(store, trainer)
    assert store.next_run == 1 and store.runs == {}
