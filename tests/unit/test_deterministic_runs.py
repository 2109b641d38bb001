"""Deterministic mode through the scheduler, without a model (issue 23, docs/deterministic.md): asked
for (or the scheduler's default when unset) at run creation, stored on the row, shown by GetInfo, sent
on every cycle item of the run (and only that run's), kept when a run's requests are replayed on a
restored adapter; asked of a trainer that cannot provide it, refused FAILED_PRECONDITION naming what
is missing, before a run number is spent or any trainer is asked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from fakes_scheduler import MODEL, FakeTrainer, fb, servicer_over_fakes
from temper.common.errors import FailedPrecondition
from temper.scheduler.api.lookup_verbs import check_deterministic
from temper.scheduler.db.request_log import LoggedRequest
from temper.scheduler.planning.cycles import build_cycle
from temper.scheduler.planning.recovery import Recovery
from temper.scheduler.planning.work import Work, WorkKind
from temper.v1 import sampler_pb2, service_pb2, trainer_pb2, types_pb2


@dataclass
class RecordingTrainer(FakeTrainer):
    """Remembers each cycle item's (run, deterministic)."""

    sent: list = field(default_factory=list)

    async def run_cycle(self, request):
        self.sent += [(item.training_run_id, item.deterministic) for item in request.forward_backward]
        return await super().run_cycle(request)


def create(api, **fields):
    return api.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
        session_id="s", base_model=MODEL, lora_config=types_pb2.LoraConfig(rank=4, seed=1), **fields), None)


@pytest.mark.parametrize("default", [False, True])
def test_the_mode_asked_or_defaulted_is_stored_shown_and_sent_with_the_runs_items_only(default):
    async def main():
        async with servicer_over_fakes(RecordingTrainer(adapters={}), deterministic_runs=default) as (s, api):
            on = await create(api, deterministic=True)
            off = await create(api, deterministic=False)
            unset = await create(api)
            assert [r.deterministic for r in (on, off, unset)] == [True, False, default]
            assert [s.store.runs[r.training_run_id].deterministic for r in (on, off, unset)] == [True, False, default]
            info = await api.GetInfo(service_pb2.GetInfoRequest(training_run_id=on.training_run_id), None)
            assert info.deterministic is True
            await asyncio.gather(*(api.ForwardBackward(fb(r.training_run_id, 1), None) for r in (on, off, unset)))
            assert sorted(s.trainer.sent) == sorted([(on.training_run_id, True), (off.training_run_id, False),
                                                     (unset.training_run_id, default)])

    asyncio.run(main())


def test_a_trainer_that_cannot_is_refused_before_anything_is_made():
    async def main():
        trainer = RecordingTrainer(adapters={})
        trainer.info.deterministic_unsupported = "deterministic mode covers the dense families; 'qwen3_moe' has none"
        async with servicer_over_fakes(trainer) as (s, api):
            with pytest.raises(FailedPrecondition, match="deterministic mode for .*'qwen3_moe' has none"):
                await create(api, deterministic=True)
            assert s.store.runs == {} and s.store.next_run == 0  # no run number spent
            assert not [e for e in s.trainer.log if e[0] == "create"]  # no trainer asked
            made = await create(api, deterministic=False)  # the default mode still works there
            assert made.deterministic is False and made.training_run_id.endswith(":train:0")

    asyncio.run(main())


def test_a_sampler_that_cannot_is_refused_by_name():
    check_deterministic(sampler_pb2.SamplerModelInfo(base_model="m"), "m")
    with pytest.raises(FailedPrecondition, match="deterministic mode for 'm': SGLang"):
        check_deterministic(sampler_pb2.SamplerModelInfo(base_model="m", deterministic_unsupported="SGLang's kernels"), "m")
    with pytest.raises(FailedPrecondition, match="sharded"):
        check_deterministic(trainer_pb2.ModelInfo(deterministic_unsupported="a sharded trainer group"), "m")


def test_a_cycle_carries_each_works_mode():
    passes = [Work("r", 1, WorkKind.FORWARD_BACKWARD, fb("r", 1)), Work("q", 1, WorkKind.FORWARD_BACKWARD, fb("q", 1))]
    passes[0].deterministic = True
    request = build_cycle(passes, [])
    assert [(i.training_run_id, i.deterministic) for i in request.forward_backward] == [("r", True), ("q", False)]


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_replay_onto_a_restored_adapter_runs_as_the_run_first_did(deterministic):
    trainer = RecordingTrainer(adapters={"r": []})
    logged = [LoggedRequest(1, "forward_backward", "done", 3, fb("r", 1).SerializeToString()),
              LoggedRequest(2, "forward_backward", "done", 3, fb("r", 2).SerializeToString())]
    asyncio.run(Recovery(None)._replay(trainer, "r", logged, deterministic))
    assert trainer.sent == [("r", deterministic), ("r", deterministic)]
