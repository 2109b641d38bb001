"""services/lora/expert_rank.py: the one routed-expert rank rule the scheduler's early check and the trainer's
LoraModel.resolve both read. Its refusals and answers, the scheduler's wording of them (``lora_config.`` in
front), and that the scheduler reads it without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from temper.common.errors import InvalidArgument
from temper.scheduler.api.lookup_verbs import check_lora_for_model
from temper.services.lora.expert_rank import ExpertRankError, default_expert_rank, resolve_expert_rank
from temper.v1 import trainer_pb2, types_pb2

# ``model`` as the scheduler words a ModelInfo's model (its base_model shown, then its family)
MOE = dict(has_experts=True, top_k=2, model="'moe' (qwen3_moe)", family="qwen3_moe")
DENSE = dict(has_experts=False, top_k=0, model="'dense' (qwen3)", family="qwen3")


@pytest.mark.parametrize("model, rank, expert_rank, adapts, expected", [
    (MOE, 8, 0, True, 4),        # the default: rank // top_k
    (MOE, 8, 3, True, 3),        # asked for
    (MOE, 1, 1, True, 1),
    (MOE, 8, 0, False, 0),       # attention only: no expert LoRA
    (DENSE, 8, 0, True, 0),
])
def test_the_rank_in_effect(model, rank, expert_rank, adapts, expected):
    assert resolve_expert_rank(rank=rank, expert_rank=expert_rank, dropout=0.0, adapts_experts=adapts, **model) == expected


@pytest.mark.parametrize("model, rank, expert_rank, dropout, message", [
    (DENSE, 8, 2, 0.0, "expert_rank is for mixture-of-experts models; 'dense' (qwen3) has no routed experts"),
    (MOE, 8, 0, 0.5, "dropout must be 0 when train_mlp adapts routed experts (qwen3_moe), got 0.5"),
    (MOE, 1, 0, 0.0, "rank 1 spread over num_experts_per_tok=2 active experts leaves no rank per expert: use rank >= 2 "
                     "or set expert_rank"),
    (MOE, 8, 9, 0.0, "expert_rank must be in [0, rank=8] (0: rank // num_experts_per_tok), got 9"),
    (MOE, 8, -1, 0.0, "expert_rank must be in [0, rank=8] (0: rank // num_experts_per_tok), got -1"),
])
def test_a_refusal_names_the_field_and_the_scheduler_says_the_same_of_its_lora_config(model, rank, expert_rank, dropout,
                                                                                          message):
    with pytest.raises(ExpertRankError) as err:
        resolve_expert_rank(rank=rank, expert_rank=expert_rank, dropout=dropout, adapts_experts=True, **model)
    assert str(err.value) == message
    info = trainer_pb2.ModelInfo(base_model=model["model"].split()[0].strip("'"), family=model["family"],
                                 num_experts=8 if model["has_experts"] else 0, num_experts_per_tok=model["top_k"])
    cfg = types_pb2.LoraConfig(rank=rank, expert_rank=expert_rank, dropout=dropout, train_mlp=True)
    with pytest.raises(InvalidArgument) as refused:
        check_lora_for_model(cfg, info)
    assert refused.value.message == "lora_config." + message


def test_a_model_naming_no_active_experts_has_no_default_rather_than_a_division_by_zero():
    assert default_expert_rank(8, 0) == 0 and default_expert_rank(8, 3) == 2


def test_the_scheduler_reads_the_rule_without_torch():
    code = ("import sys, temper.scheduler.api.lookup_verbs, temper.services.lora.expert_rank\n"
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ""
