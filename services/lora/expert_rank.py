"""The routed experts' LoRA rank: one rule, read by the trainer (``LoraModel.resolve``) and by the
scheduler's early check (``check_lora`` and ``check_lora_for_model``, before a run number is spent).

Pure Python (no torch): the scheduler imports it. A refusal is an ``ExpertRankError`` (a ValueError)
whose message names the field; ``prefix`` puts the scheduler's ``lora_config.`` in front of it.
"""

from __future__ import annotations


class ExpertRankError(ValueError):
    """A LoRA config the rule refuses; the message names the field at fault."""


def default_expert_rank(rank: int, top_k: int) -> int:
    """Each routed expert's LoRA rank when the run does not set one: the run's rank spread over the
    experts a token activates (LoRA Without Regret's convention: a token then sees about ``rank``
    dimensions of adapter in every MoE layer, as in a dense layer of the same rank). 0: too small (or a
    model that names no active experts)."""
    return rank // top_k if top_k > 0 else 0


def check_range(rank: int, expert_rank: int, prefix: str = "") -> None:
    """``expert_rank`` in [0, rank], whatever the model (0 asks for the default)."""
    if not 0 <= expert_rank <= rank:
        raise ExpertRankError(f"{prefix}expert_rank must be in [0, rank={rank}] (0: rank // num_experts_per_tok), "
                              f"got {expert_rank}")


def resolve_expert_rank(*, rank: int, expert_rank: int, dropout: float, has_experts: bool, adapts_experts: bool,
                        top_k: int, model: str, family: str, prefix: str = "") -> int:
    """The routed experts' rank in effect for a LoRA config (0: no expert LoRA), or ExpertRankError.

    ``has_experts``: the model has routed experts; ``adapts_experts``: the config adapts them (an MoE
    model's MLP); ``top_k``: experts a token activates; ``model`` says which model in a message (the
    no-experts one), ``family`` its family (the dropout one)."""
    check_range(rank, expert_rank, prefix)
    if not has_experts:
        if expert_rank:
            raise ExpertRankError(f"{prefix}expert_rank is for mixture-of-experts models; {model} has no routed experts")
        return 0
    if not adapts_experts:
        return 0
    if dropout:
        # peft's target_parameters (how a saved adapter holds the experts' LoRA) have no dropout
        raise ExpertRankError(f"{prefix}dropout must be 0 when train_mlp adapts routed experts ({family}), got {dropout}")
    resolved = expert_rank or default_expert_rank(rank, top_k)
    if resolved < 1:
        raise ExpertRankError(f"{prefix}rank {rank} spread over num_experts_per_tok={top_k} active experts leaves no "
                              f"rank per expert: use rank >= {top_k} or set expert_rank")
    return resolved
