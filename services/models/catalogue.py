"""Where each base model runs: its layout over devices, from a JSON catalogue (issue 20, model sharding).

``TEMPER_MODEL_CATALOGUE`` (to become a TEMPER_ setting) maps a base-model name to a ``ModelLayout``;
a model not listed runs on the default layout, one device everywhere::

    TEMPER_MODEL_CATALOGUE='{"Qwen/Qwen3-235B-A22B": {"ranks_per_trainer": 8, "sampler_tp_size": 8}}'

``python -m temper.plan`` says which layouts fit a model on given devices; ``check_divides`` refuses
a layout whose sizes do not divide the model's shapes where they must. Imports pydantic only (no
torch, no transformers): the config passed in is any object with a transformers config's fields.
"""

from __future__ import annotations

import json
import os

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

CATALOGUE_ENV = "TEMPER_MODEL_CATALOGUE"


class ModelLayout(BaseModel):
    """One base model's layout.

    ``ranks_per_trainer``: the ranks of one trainer group; the frozen base weights are FSDP2-sharded
    over them (every rank holds 1/N of every parameter), the LoRA adapters and their optimizer state
    replicated on each, the cycle's rows split data-parallel. ``devices_per_rank``: accelerators one
    rank drives. ``sampler_tp_size`` / ``sampler_dp_size``: the sampler's tensor-parallel and
    data-parallel sizes (SGLang's ``--tp-size`` / ``--dp-size``). ``experts_per_rank``: routed experts
    placed whole on ranks (expert parallel) instead of sharded with the rest of the weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ranks_per_trainer: int = Field(1, ge=1)
    devices_per_rank: int = Field(1, ge=1)
    sampler_tp_size: int = Field(1, ge=1)
    sampler_dp_size: int = Field(1, ge=1)
    experts_per_rank: bool = False

    @property
    def trainer_devices(self) -> int:
        return self.ranks_per_trainer * self.devices_per_rank

    @property
    def sampler_devices(self) -> int:
        return self.sampler_tp_size * self.sampler_dp_size


DEFAULT_LAYOUT = ModelLayout()


class Catalogue(RootModel[dict[str, ModelLayout]]):
    """Base-model name -> ModelLayout; ``layout(name)`` is the default layout for a model not listed."""

    root: dict[str, ModelLayout] = Field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str | None) -> "Catalogue":
        """Parses the setting's JSON (empty or None: no entries). ValueError naming the model and the
        field that is wrong, with the value given."""
        if text is None or not text.strip():
            return cls({})
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{CATALOGUE_ENV} is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{CATALOGUE_ENV} must be a JSON object of model name -> layout, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                where = ".".join(str(p) for p in error["loc"])
                problems.append(f"{where}={error.get('input')!r}: {error['msg']}")
            raise ValueError(f"{CATALOGUE_ENV}: " + "; ".join(problems)) from None

    @classmethod
    def from_env(cls, environ=None) -> "Catalogue":
        return cls.from_json((environ if environ is not None else os.environ).get(CATALOGUE_ENV))

    def layout(self, name: str) -> ModelLayout:
        return self.root.get(name, DEFAULT_LAYOUT)

    def __contains__(self, name: str) -> bool:
        return name in self.root

    def check(self, configs: dict) -> None:
        """``check_divides`` for every listed model whose config is in ``configs`` (name -> config)."""
        for name, layout in self.root.items():
            if name in configs:
                check_divides(configs[name], layout, name)


def _text(config):
    return getattr(config, "text_config", None) or config


def _num_experts(config) -> int:
    text = _text(config)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(text, name, None)
        if value:
            return int(value)
    return 0


def check_divides(config, layout: ModelLayout, name: str = "") -> None:
    """Refuses (ValueError naming the numbers) a layout that does not divide the model where it must.

    - Trainer, FSDP2 over ``ranks_per_trainer`` ranks: nothing must divide (FSDP2 shards every
      parameter on dim 0 and pads the last shard), so any N >= 1 is accepted.
    - Trainer, ``experts_per_rank`` (routed experts placed whole on ranks): ``experts % ranks_per_trainer == 0``
      (every rank holds the same number of experts).
    - Sampler, tensor parallel ``sampler_tp_size`` = tp: attention heads split over tp ranks,
      ``heads % tp == 0``; key/value heads split or replicated, ``kv_heads % tp == 0`` or
      ``tp % kv_heads == 0``; the MLP's columns split, ``intermediate_size % tp == 0`` (dense MLPs,
      an MoE model's dense layers, GPT-OSS's experts) and ``moe_intermediate_size % tp == 0`` (routed
      and shared experts), for each of the two the config has.
    - ``sampler_dp_size``, ``devices_per_rank``: nothing must divide.
    """
    text = _text(config)
    label = f"{name}: " if name else ""
    ranks, tp = layout.ranks_per_trainer, layout.sampler_tp_size
    experts = _num_experts(config)
    if layout.experts_per_rank:
        if not experts:
            raise ValueError(f"{label}experts_per_rank is for mixture-of-experts models; this one has no routed experts")
        if experts % ranks:
            raise ValueError(f"{label}{experts} routed experts do not divide over ranks_per_trainer={ranks} "
                             f"(experts placed per rank: {experts} % {ranks} = {experts % ranks})")
    if tp > 1:
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        if heads % tp:
            raise ValueError(f"{label}{heads} attention heads do not split over sampler_tp_size={tp} "
                             f"({heads} % {tp} = {heads % tp})")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"{label}{kv_heads} key/value heads neither split over nor replicate to "
                             f"sampler_tp_size={tp} ({kv_heads} % {tp} = {kv_heads % tp}, {tp} % {kv_heads} = {tp % kv_heads})")
        # a dense MLP's (and dense first layers', GPT-OSS's experts') intermediate_size, routed experts' moe_intermediate_size
        for field in ("intermediate_size", "moe_intermediate_size"):
            width = getattr(text, field, None)
            if width and int(width) % tp:
                raise ValueError(f"{label}{field}={int(width)} does not split over sampler_tp_size={tp} "
                                 f"({int(width)} % {tp} = {int(width) % tp})")
