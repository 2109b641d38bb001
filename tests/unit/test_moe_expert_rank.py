"""The routed experts' LoRA rank (LoraConfig.expert_rank) through the scheduler and the clients, without a
model: checked on creation, stored as the trainer answered it (the rank in effect, not the 0 that asks
for the default), shown on the run's info and its checkpoints, asked for again when an adapter is
rebuilt, part of the layout LoadWeights compares; the capabilities carry the model's family and routed
experts (gRPC, the temper client, the Tinker gateway's JSON, which the SDK's types accept)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from fakes_scheduler import MODEL, FakeTrainer, servicer_over_fakes
from temper.client import convert as client_convert
from temper.client import types as t
from temper.common.errors import FailedPrecondition, InvalidArgument
from temper.scheduler.db import models as m
from temper.scheduler.api.lookup_verbs import check_lora, check_lora_for_model
from temper.scheduler.planning.recovery import Recovery
from temper.scheduler.planning.runs import created_expert_rank, new_run_row
from temper.scheduler.api.servicer import lora_layout
from temper.scheduler.db.views import checkpoint_message, lora_of, run_message
from temper.services.gateway.convert import capabilities_to_json
from temper.v1 import service_pb2, trainer_pb2, types_pb2


# ---- checks and rows ----------------------------------------------------------------------------

@pytest.mark.parametrize("expert_rank", [0, 1, 4, 8])
def test_an_expert_rank_within_the_rank_is_accepted(expert_rank):
    check_lora(types_pb2.LoraConfig(rank=8, train_mlp=True, expert_rank=expert_rank))


@pytest.mark.parametrize("expert_rank", [9, -1, 2**31 - 1])
def test_an_expert_rank_outside_0_to_rank_is_refused_naming_the_field(expert_rank):
    with pytest.raises(InvalidArgument, match=r"lora_config\.expert_rank must be in \[0, rank=8\]") as err:
        check_lora(types_pb2.LoraConfig(rank=8, train_mlp=True, expert_rank=expert_rank))
    assert str(expert_rank) in err.value.message


DENSE = trainer_pb2.ModelInfo(base_model="dense", family="qwen3")
MOE = trainer_pb2.ModelInfo(base_model="moe", family="qwen3_moe", num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("info, cfg, field", [
    (DENSE, types_pb2.LoraConfig(rank=8, train_mlp=True, expert_rank=2), "expert_rank is for mixture-of-experts"),
    (MOE, types_pb2.LoraConfig(rank=1, train_mlp=True), "rank 1 spread over num_experts_per_tok=2"),
    (MOE, types_pb2.LoraConfig(rank=8, train_mlp=True, dropout=0.1), "dropout must be 0"),
])
def test_what_the_models_trainer_would_refuse_is_refused_before_a_run_number_is_spent(info, cfg, field):
    with pytest.raises(InvalidArgument, match=field):
        check_lora_for_model(cfg, info)


@pytest.mark.parametrize("info, cfg", [
    (DENSE, types_pb2.LoraConfig(rank=8, train_mlp=True)),
    (MOE, types_pb2.LoraConfig(rank=1, train_mlp=True, expert_rank=1)),
    (MOE, types_pb2.LoraConfig(rank=1, train_attn=True, dropout=0.1)),   # no expert LoRA: any rank, dropout
    (MOE, types_pb2.LoraConfig(rank=2, train_mlp=True)),
])
def test_what_the_models_trainer_accepts_passes(info, cfg):
    check_lora_for_model(cfg, info)


def test_the_row_stores_the_rank_the_trainer_answered_and_the_run_info_shows_it():
    asked = types_pb2.LoraConfig(rank=8, alpha=16.0, seed=3, train_mlp=True)  # expert_rank 0: the default
    row = new_run_row("s:train:0", "s", "m", asked, {}, "trainer:1", None,
                      created_expert_rank(trainer_pb2.CreateAdapterResponse(expert_rank=4)))
    assert row.lora_expert_rank == 4 and row.lora_rank == 8
    assert lora_of(row).expert_rank == 4 and lora_of(row).rank == 8 and lora_of(row).seed == 3
    info = run_message(row, "alice", 1, trainer_pb2.ModelInfo(vocab_size=10))
    assert info.lora_config.expert_rank == 4
    checkpoint = m.Checkpoint(training_run_id=row.id, kind="training", name="a", path="tinker://s:train:0/weights/a", size_bytes=1)
    assert checkpoint_message(checkpoint, row).lora_config.expert_rank == 4


def test_an_answer_without_expert_lora_and_a_row_of_before_0009_read_as_0():
    assert created_expert_rank(trainer_pb2.CreateAdapterResponse()) == 0
    assert created_expert_rank(None) == 0
    assert new_run_row("s:train:0", "s", "m", types_pb2.LoraConfig(rank=4, train_attn=True), {}, "t:1", None).lora_expert_rank == 0
    unflushed = m.TrainingRun(id="r", session_id="s", base_model="m", lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, seed=None,
                              train_attn=True, train_mlp=True, train_unembed=False)  # the column's default is applied on insert
    assert lora_of(unflushed).expert_rank == 0 and lora_layout(unflushed)[4] == 0


def test_a_run_of_another_expert_rank_has_another_layout():
    def row(expert_rank):
        return SimpleNamespace(lora_rank=8, train_attn=True, train_mlp=True, train_unembed=False, lora_expert_rank=expert_rank)

    assert lora_layout(row(2)) != lora_layout(row(4))
    assert lora_layout(row(4)) == lora_layout(row(4)) == (8, True, True, False, 4)


def test_a_fresh_adapter_of_a_rebuilt_run_asks_for_the_stored_expert_rank():
    class Trainer:
        address = "trainer:1"

        def __init__(self):
            self.calls = []

        async def call(self, method, request):
            self.calls.append((method, request))
            return trainer_pb2.CreateAdapterResponse() if method == "CreateAdapter" else trainer_pb2.DropAdapterResponse()

    trainer = Trainer()
    row = new_run_row("s:train:0", "s", "m", types_pb2.LoraConfig(rank=8, seed=5, train_mlp=True), {}, "trainer:1", None, 4)
    asyncio.run(Recovery(None)._fresh_adapter(trainer, row))
    [(drop, _), (create, request)] = trainer.calls
    assert (drop, create) == ("DropAdapter", "CreateAdapter")
    assert request.lora_config.expert_rank == 4 and request.lora_config.rank == 8 and request.lora_config.seed == 5


# ---- the servicer over fakes --------------------------------------------------------------------

class _MoeTrainer(FakeTrainer):
    """Answers CreateAdapter as the trainer does on an MoE model of top-2 routing: the expert rank in effect."""

    @classmethod
    def serving_moe(cls, **kwargs) -> "_MoeTrainer":
        trainer = cls(**kwargs)
        trainer.info.family, trainer.info.num_experts, trainer.info.num_experts_per_tok = "qwen3_moe", 8, 2
        return trainer

    async def call(self, method, request):
        answer = await super().call(method, request)
        if method != "CreateAdapter":
            return answer
        cfg = request.lora_config
        return trainer_pb2.CreateAdapterResponse(expert_rank=(cfg.expert_rank or cfg.rank // 2) if cfg.train_mlp else 0)


servicer = servicer_over_fakes


def create(api, **lora):
    return api.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(
        session_id="s", base_model=MODEL, lora_config=types_pb2.LoraConfig(seed=1, **lora)), None)


def test_create_training_run_stores_the_trainers_expert_rank_and_refuses_a_bad_one_before_anything():
    async def main():
        async with servicer(_MoeTrainer.serving_moe(adapters={})) as (s, api):
            default = await create(api, rank=8, train_mlp=True)
            asked = await create(api, rank=8, train_mlp=True, expert_rank=2)
            dense = await create(api, rank=8, train_attn=True, train_mlp=False)  # unset train_mlp would be Tinker's True
            assert [r.lora_config.expert_rank for r in (default, asked, dense)] == [4, 2, 0]
            assert [s.store.runs[r.training_run_id].lora_expert_rank for r in (default, asked, dense)] == [4, 2, 0]
            info = await api.GetInfo(service_pb2.GetInfoRequest(training_run_id=default.training_run_id), None)
            assert info.lora_config.expert_rank == 4
            with pytest.raises(InvalidArgument, match="expert_rank"):
                await create(api, rank=8, train_mlp=True, expert_rank=9)
            assert len(s.store.runs) == 3 and s.store.next_run == 3  # refused before a run id was reserved
            assert [("create", r.training_run_id, 1) for r in (default, asked, dense)] == [e for e in s.trainer.log if e[0] == "create"]

    asyncio.run(main())


def test_a_checkpoint_of_another_expert_rank_is_refused_at_admission():
    async def main():
        trainer = FakeTrainer(adapters={"r": [], "src": []})
        async with servicer(trainer) as (s, api):
            for run_id in ("r", "src"):
                s.store.add_run(run_id, "alice")
            s.store.runs["r"].lora_expert_rank, s.store.runs["src"].lora_expert_rank = 2, 1
            s.store.readable_checkpoint = lambda path, tenant: SimpleNamespace(training_run_id=path.split("/")[2])
            request = service_pb2.LoadWeightsRequest(training_run_id="r", seq_id=1, path="tinker://src/weights/a")
            with pytest.raises(FailedPrecondition, match=r"routed experts rank 1\) on attention\+MLP; run r has LoRA rank 4 "
                                                         r"\(routed experts rank 2\)"):
                await api.LoadWeights(request, None)
            assert ("r", 1) not in s.store.requests and trainer.adapters["r"] == []
            s.store.runs["src"].lora_expert_rank = 2
            request.seq_id = 2  # (seq 1 answers its refusal again)
            await api.LoadWeights(request, None)
            assert trainer.adapters["r"] == [("load", "src/weights/a")]

    asyncio.run(main())


def test_capabilities_carry_the_family_and_routed_experts_of_the_trainers_model():
    async def main():
        moe = FakeTrainer(info=trainer_pb2.ModelInfo(base_model=MODEL, max_context_length=64, family="qwen3_moe", num_experts=8,
                                                     num_experts_per_tok=2))
        async with servicer(moe) as (_, api):
            [model] = (await api.GetServerCapabilities(service_pb2.GetServerCapabilitiesRequest(), None)).supported_models
            assert (model.model_name, model.family, model.num_experts, model.num_experts_per_tok) == (MODEL, "qwen3_moe", 8, 2)
        async with servicer(FakeTrainer()) as (_, api):  # a trainer that names no family: unset
            [model] = (await api.GetServerCapabilities(service_pb2.GetServerCapabilitiesRequest(), None)).supported_models
            assert (model.family, model.num_experts, model.num_experts_per_tok, model.trainable) == ("", 0, 0, True)

    asyncio.run(main())


# ---- clients ------------------------------------------------------------------------------------

def test_the_client_lora_config_carries_expert_rank_both_ways():
    message = client_convert.lora_to_proto(t.LoraConfig(rank=8, expert_rank=2))
    assert message.expert_rank == 2 and message.rank == 8
    assert client_convert.lora_to_proto(t.LoraConfig(rank=8)).expert_rank == 0  # the default: the server's
    assert client_convert.lora_from_proto(message).expert_rank == 2
    info = client_convert.info_from_proto(service_pb2.TrainingRunInfo(
        training_run_id="s:train:0", base_model="m", lora_config=types_pb2.LoraConfig(rank=8, expert_rank=4)))
    assert info.expert_rank == 4 and info.lora_config.expert_rank == 4 and info.lora_rank == 8


def test_gateway_capabilities_json_has_the_experts_and_the_tinker_sdk_accepts_it():
    response = service_pb2.GetServerCapabilitiesResponse(supported_models=[
        service_pb2.SupportedModel(model_name="moe", max_context_length=64, trainable=True, sampleable=True, family="qwen3_moe",
                                   num_experts=8, num_experts_per_tok=2),
        service_pb2.SupportedModel(model_name="dense", max_context_length=64, trainable=True, family="qwen3")])
    body = capabilities_to_json(response)
    assert body["supported_models"][0] == {"model_name": "moe", "max_context_length": 64, "trainable": True, "sampleable": True,
                                           "family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}
    assert body["supported_models"][1]["num_experts"] == 0
    tinker_types = pytest.importorskip("tinker.types")
    parsed = tinker_types.GetServerCapabilitiesResponse.model_validate(body)  # extra="ignore": the SDK drops what it does not know
    assert [m.model_name for m in parsed.supported_models] == ["moe", "dense"]
