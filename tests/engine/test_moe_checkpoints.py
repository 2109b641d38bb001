"""Mixture-of-experts adapters in peft's file format, both ways, and the bad input around them.

1. Vanilla peft loads Temper's saved MoE adapter (routed experts as ``target_parameters`` with their
   rank in ``rank_pattern``; deepseek_v3's dense MLP and shared experts as ``gate_proj.weight`` etc.):
   ``PeftModel.from_pretrained`` on a fresh base model gives Temper's routed logits, every family,
   attention + MLP and MLP only.
2. An adapter made by peft itself (``get_peft_model`` with a hand-written LoraConfig in Temper's layout,
   ``save_pretrained``) is accepted by ImportCheckpoint (``imports.check_adapter_folder``), reports the
   run config it fits, loads into such a run and gives peft's logits.
3. Bad input is INVALID_ARGUMENT naming what is wrong, with nothing written or changed: expert counts
   that are not the model's, rank_pattern on a non-target, expert rank > r, dropout on expert targets,
   unknown target_parameters; expert rank 0 (rank < num_experts_per_tok); configs that cannot be right
   (families.check_config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import peft
import pytest
import torch
from safetensors.torch import load, save
from transformers import AutoConfig

from temper.common.errors import InvalidArgument
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models import families
from temper.services.models.loading import load_model
from temper.services.trainer.convert import adapter_from_pb
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.imports import CONFIG_FILE, WEIGHTS_FILE
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import types_pb2


FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
TOL = dict(atol=1e-5, rtol=1e-5)
# peft 0.21 checks rank_pattern keys against target_modules only and warns that target_parameters keys were
# "ignored"; it does apply them to the wrapped parameters (the shapes below would not load otherwise)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match")]

# hand-written, not from Temper's own peft_config: what a peft user writes for the same layout
PEFT_ATTENTION = {"qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"], "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],
                  "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
PEFT_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PEFT_DENSE_MLP = {"qwen3_moe": [], "gpt_oss": [], "deepseek_v3": ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]}




@pytest.fixture(scope="module")
def folders(family_dirs) -> dict[str, str]:
    return {family: str(family_dirs[family]) for family in FAMILIES}


def _ids(vocab: int, rows: int = 3, seq: int = 9) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(21))


def _randomize(params: dict, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=generator)


def _fresh_base(folder: str):
    return load_model(folder).model


def _routed_logits(lora: LoraModel, key: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows 0 and 1 with ``key``, row 2 without adapter (the routing of a shared batch)."""
    with torch.no_grad(), lora.route([(key, torch.tensor([0, 1]))]):
        return lora.model(ids).logits


# ---- 1. vanilla peft loads what Temper saves ------------------------------------------------------


@pytest.mark.parametrize("groups", ["attention+mlp", "mlp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_vanilla_peft_loads_temper_moe_adapter_with_the_same_logits(folders, family, groups, tmp_path):
    loaded = load_model(folders[family])
    lora = LoraModel(loaded.model, loaded.name)
    targets = lora.group_targets(attn=groups == "attention+mlp", mlp=True)
    adapter = lora.add("a", AdapterSpec(rank=4, alpha=8, targets=targets), seed=1)
    assert adapter.spec.expert_rank == 2
    _randomize(adapter.params, seed=2)
    lora.save("a", tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert set(PEFT_EXPERTS) <= set(config["target_parameters"])
    assert config["rank_pattern"] == {t: 2 for t in PEFT_EXPERTS}

    ids = _ids(loaded.model.config.vocab_size)
    want = _routed_logits(lora, "a", ids)
    model = peft.PeftModel.from_pretrained(_fresh_base(folders[family]), str(tmp_path))
    with torch.no_grad():
        got = model(ids[:2]).logits
        base = lora.model(ids).logits
    torch.testing.assert_close(got, want[:2], **TOL)
    torch.testing.assert_close(want[2], base[2], **TOL)
    assert (want[:2] - base[:2]).abs().max() > 1e-3  # the adapter does something
    # every tensor Temper wrote is one peft holds (same name, shape and values): nothing left unloaded
    held = {n.replace(".default", ""): p for n, p in model.named_parameters() if ".lora_" in n}
    saved = lora.state_dict("a")
    assert held.keys() == saved.keys()
    assert all(torch.equal(held[n].detach(), saved[n]) for n in saved)


# ---- 2. what peft makes imports into Temper -------------------------------------------------------


@pytest.fixture(scope="module")
def engines(folders, tmp_path_factory) -> dict[str, TrainerEngine]:
    return {family: TrainerEngine(load_model(folder), TrainerSettings(checkpoint_dir=tmp_path_factory.mktemp(f"ckpt-{family}")))
            for family, folder in folders.items()}


def _peft_made(folder: str, family: str, tmp: Path, rank: int, expert_rank: int | None, seed: int):
    """A peft model of ``family``'s attention + MLP groups in Temper's layout, its B random, and its saved files."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PEFT_ATTENTION[family],
                             target_parameters=PEFT_EXPERTS + PEFT_DENSE_MLP[family],
                             rank_pattern={t: expert_rank for t in PEFT_EXPERTS} if expert_rank else {})
    model = peft.get_peft_model(_fresh_base(folder), config)
    _randomize(dict(model.named_parameters()), seed)
    model.save_pretrained(str(tmp))
    return model, {name: (tmp / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


@pytest.mark.parametrize("expert_rank", [2, None], ids=["rank_pattern", "no rank_pattern"])
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_made_moe_adapter_imports_and_matches_peft(folders, engines, family, expert_rank, tmp_path):
    engine = engines[family]
    model, files = _peft_made(folders[family], family, tmp_path, rank=4 if expert_rank else 2, expert_rank=expert_rank,
                              seed=3)
    key = f"peft-made/sampler_weights/{family}-{expert_rank}"
    _, imported = engine.import_checkpoint(key, files)
    want_rank = 4 if expert_rank else 2
    assert (imported.rank, imported.expert_rank, imported.alpha) == (want_rank, expert_rank or 2, 2.0 * want_rank)
    assert (imported.train_attn, imported.train_mlp, imported.train_unembed) == (True, True, False)
    # a run of the config the import reports takes the weights, and routes like peft
    spec, _ = adapter_from_pb(types_pb2.LoraConfig(**dataclasses.asdict(imported)), default_alpha=32.0, lora=engine.lora)
    run = f"run-{family}-{expert_rank}"
    engine.create_adapter(run, spec, seed=0)
    try:
        engine.load(run, key, False)
        ids = _ids(engine.loaded.vocab_size)
        want = _routed_logits(engine.lora, run, ids)
        with torch.no_grad():
            got = model(ids[:2]).logits
        torch.testing.assert_close(want[:2], got, **TOL)
    finally:
        engine.drop_adapter(run)


# ---- 3. bad input ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uniform_files(engines, folders, tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Per family, a valid peft-made attention + MLP adapter whose experts have rank r (no rank_pattern)."""
    return {family: _peft_made(folders[family], family, tmp_path_factory.mktemp(f"uniform-{family}"), rank=2,
                               expert_rank=None, seed=4)[1] for family in FAMILIES}


def _config(files, **changes):
    config = json.loads(files[CONFIG_FILE])
    config.update(changes)
    return {**files, CONFIG_FILE: json.dumps(config).encode()}


def _experts(files, count: int):
    """Every routed-experts tensor as if the model had ``count`` experts (peft layout: A rows e*r..(e+1)*r,
    B columns e, E+e, ...): fewer drop the last experts, more add random ones."""
    tensors = load(files[WEIGHTS_FILE])
    r, experts = 2, 8
    generator = torch.Generator().manual_seed(5)
    for name, t in list(tensors.items()):
        if ".mlp.experts." not in name:
            continue
        if ".lora_A." in name:
            a = t.view(experts, r, -1)
            extra = torch.randn(max(count - experts, 0), r, a.shape[-1], generator=generator)
            tensors[name] = torch.cat([a[:count], extra]).reshape(count * r, -1).contiguous()
        else:
            b = t.view(t.shape[0], r, experts)
            extra = torch.randn(t.shape[0], r, max(count - experts, 0), generator=generator)
            tensors[name] = torch.cat([b[:, :, :count], extra], dim=2).reshape(t.shape[0], r * count).contiguous()
    return {**files, WEIGHTS_FILE: save(tensors)}


BAD = {
    # case: (edit of a valid adapter's files, words the message must hold)
    "6 experts": (lambda f, fam: _experts(f, 6), ["mlp.experts", "6 experts", "8 routed experts"]),
    "10 experts": (lambda f, fam: _experts(f, 10), ["mlp.experts", "10 experts", "8 routed experts"]),
    "rank_pattern on a non-target": (lambda f, fam: _config(f, rank_pattern={PEFT_ATTENTION[fam][0]: 1}),
                                     ["rank_pattern", "target_parameters"]),
    "expert rank > r": (lambda f, fam: _config(f, rank_pattern={t: 3 for t in PEFT_EXPERTS}), ["rank_pattern", "r=2"]),
    "unequal expert ranks": (lambda f, fam: _config(f, rank_pattern=dict(zip(PEFT_EXPERTS, (1, 2)))), ["rank_pattern"]),
    "dropout with expert targets": (lambda f, fam: _config(f, lora_dropout=0.1), ["dropout"]),
    "unknown target_parameter": (
        lambda f, fam: _config(f, target_parameters=PEFT_EXPERTS + PEFT_DENSE_MLP[fam] + ["mlp.experts.gate_up_proj_bias"]),
        ["target_parameters"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("family", FAMILIES)
def test_bad_moe_imports_are_refused_by_name_with_nothing_written(engines, uniform_files, family, case):
    engine, files = engines[family], uniform_files[family]
    edit, words = BAD[case]
    key = f"bad-moe/sampler_weights/{family}-{case.replace(' ', '-').replace('>', 'gt')}"
    adapters_before = set(engine.lora.adapters)
    with pytest.raises(InvalidArgument) as refused:
        engine.import_checkpoint(key, edit(files, family))
    message = refused.value.message
    assert all(w in message for w in words), f"{case}: {message!r} does not name {words}"
    assert not engine.store.exists(key)
    parent = engine.store.path(key).parent
    assert not parent.exists() or not any(parent.iterdir())  # no staging folder left behind
    assert set(engine.lora.adapters) == adapters_before


def test_the_valid_base_of_the_bad_cases_imports(engines, uniform_files):
    """The files the bad cases edit are themselves accepted (each refusal is the edit's doing)."""
    for family in FAMILIES:
        _, imported = engines[family].import_checkpoint(f"good-moe/sampler_weights/{family}", uniform_files[family])
        assert (imported.rank, imported.expert_rank, imported.train_mlp) == (2, 2, True)


@pytest.mark.parametrize("family", FAMILIES)
def test_rank_below_top_k_without_expert_rank_is_refused_by_name(engines, family):
    engine = engines[family]
    targets = engine.lora.group_targets(mlp=True)
    before = (set(engine.host.adapters), set(engine.lora.adapters))
    with pytest.raises(InvalidArgument) as refused:
        engine.create_adapter("rank-one", AdapterSpec(rank=1, alpha=2, targets=targets))
    assert "rank" in refused.value.message and "num_experts_per_tok=2" in refused.value.message
    assert (set(engine.host.adapters), set(engine.lora.adapters)) == before
    assert all("rank-one" not in w.adapters for w in engine.lora.experts.values())
    # an explicit expert rank makes the same rank-1 adapter fine
    adapter = engine.create_adapter("rank-one", AdapterSpec(rank=1, alpha=2, targets=targets, expert_rank=1))
    assert adapter.spec.expert_rank == 1
    engine.drop_adapter("rank-one")


@pytest.mark.parametrize("top_k", [9, 0])
@pytest.mark.parametrize("family", FAMILIES)
def test_check_config_refuses_top_k_outside_the_experts_by_name(folders, family, top_k):
    config = AutoConfig.from_pretrained(folders[family])
    families.check_config(config)
    config.num_experts_per_tok = top_k
    with pytest.raises(families.UnknownFamily, match="num_experts_per_tok"):
        families.check_config(config)


@pytest.mark.parametrize("family, field", [("qwen3_moe", "moe_intermediate_size"), ("gpt_oss", "num_local_experts"),
                                           ("deepseek_v3", "kv_lora_rank"), ("deepseek_v3", "n_routed_experts")])
def test_check_config_names_a_missing_field(folders, family, field):
    """transformers 5 configs are strict dataclasses: a deleted attribute falls back to the class default and
    None is refused on assignment, so the config object lacking the field is a plain namespace of its fields."""
    config = AutoConfig.from_pretrained(folders[family])
    fields = {**config.to_dict(), **{name: getattr(config, name) for name in families.family_of(config).required}}
    families.check_config(SimpleNamespace(**fields))
    del fields[field]
    with pytest.raises(families.UnknownFamily, match=field):
        families.check_config(SimpleNamespace(**fields))
