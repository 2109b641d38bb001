"""Importing an outside peft LoRA adapter as a checkpoint (services/trainer/imports.py): the files of a
trained adapter, imported under another key, sample exactly like the original and load into a run
of the config they map to; damaged or mismatched files are refused with nothing written."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from temper.common.errors import InvalidArgument
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.sampler.backend import SamplingOptions
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.convert import adapter_from_pb
from temper.v1 import types_pb2
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.imports import CONFIG_FILE, WEIGHTS_FILE
from temper.services.trainer.settings import TrainerSettings

ORIGINAL, IMPORTED = "run-a/sampler_weights/orig", "other-tenant-run/sampler_weights/imported"


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    """An engine with a trained-looking adapter saved as ORIGINAL, and that checkpoint's files."""
    engine = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(checkpoint_dir=tmp_path_factory.mktemp("ckpt")))
    engine.create_adapter("run-a", AdapterSpec(rank=4, alpha=8, targets=lora_targets(attn=True, unembed=True)), seed=3)
    with torch.no_grad():
        for p in engine.lora.adapters["run-a"].params.values():
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(7))
    engine.save("run-a", ORIGINAL, False)
    folder = engine.store.existing(ORIGINAL)
    return engine, {name: (folder / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def test_imported_adapter_samples_like_the_original_and_loads_into_a_run(exported, tiny_model_dir):
    engine, files = exported
    size, config = engine.import_checkpoint(IMPORTED, files)
    assert size == sum(len(b) for b in files.values())
    assert (config.rank, config.alpha, config.train_attn, config.train_mlp, config.train_unembed) == (4, 8, True, False, True)
    sampler = TorchSamplerBackend(load_model(tiny_model_dir))
    sampler.load_adapter("orig", engine.store.existing(ORIGINAL))
    sampler.load_adapter("imported", engine.store.existing(IMPORTED))
    prompt = np.array([5, 17, 42, 9], dtype=np.int32)
    options = SamplingOptions(max_tokens=8, temperature=1.0, seed=11, stop_disabled=True)
    want = sampler.sample("orig", prompt, 2, options, True)
    got = sampler.sample("imported", prompt, 2, options, True)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]
    base = sampler.sample(None, prompt, 2, options, False)
    assert [s.tokens for s in base.sequences] != [s.tokens for s in want.sequences]  # the adapter does something
    # load_state: a run made with the config the import reports takes the weights exactly
    spec, _ = adapter_from_pb(types_pb2.LoraConfig(**dataclasses.asdict(config)), default_alpha=32.0)
    engine.create_adapter("run-b", spec, seed=0)
    engine.load("run-b", IMPORTED, False)
    a, b = engine.lora.state_dict("run-a"), engine.lora.state_dict("run-b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _config(files, **changes):
    config = json.loads(files[CONFIG_FILE])
    config.update(changes)
    return {**files, CONFIG_FILE: json.dumps(config).encode()}


def _weights(files, edit):
    tensors = load(files[WEIGHTS_FILE])
    edit(tensors)
    return {**files, WEIGHTS_FILE: save(tensors)}


def _first_a(tensors):
    return next(k for k in sorted(tensors) if k.endswith("lora_A.weight"))


BAD = {
    "truncated weights": lambda f: {**f, WEIGHTS_FILE: f[WEIGHTS_FILE][: len(f[WEIGHTS_FILE]) // 2]},
    "not JSON": lambda f: {**f, CONFIG_FILE: b"{nope"},
    "other base model": lambda f: _config(f, base_model_name_or_path="meta-llama/Llama-3-8B"),
    "rank mismatch": lambda f: _config(f, r=8),
    "DoRA": lambda f: _config(f, use_dora=True),
    "partial targets": lambda f: _config(f, target_modules=["q_proj", "v_proj"]),
    "unknown module": lambda f: _config(f, target_modules=["lm_head", "nope_proj"]),
    "not LoRA": lambda f: _config(f, peft_type="IA3"),
    "extra file": lambda f: {**f, "README.md": b"hi"},
    "missing weights": lambda f: {CONFIG_FILE: f[CONFIG_FILE]},
    "wrong shape": lambda f: _weights(f, lambda t: t.update({_first_a(t): torch.zeros(3, t[_first_a(t)].shape[1])})),
    "missing tensor": lambda f: _weights(f, lambda t: t.pop(_first_a(t))),
    "NaN": lambda f: _weights(f, lambda t: t[_first_a(t)].fill_(float("nan"))),
    "integer dtype": lambda f: _weights(f, lambda t: t.update({_first_a(t): t[_first_a(t)].to(torch.int32)})),
    "float64": lambda f: _weights(f, lambda t: t.update({_first_a(t): t[_first_a(t)].to(torch.float64)})),
    "inf": lambda f: _weights(f, lambda t: t[_first_a(t)].fill_(float("inf"))),
    "modules_to_save": lambda f: _config(f, modules_to_save=["lm_head"]),
    "rank 0": lambda f: _config(f, r=0),
    "huge rank": lambda f: _config(f, r=1 << 20),
    "garbage weights": lambda f: {**f, WEIGHTS_FILE: bytes(range(256)) * 4},
}


def _tree(root):
    """Every folder and file under ``root`` with the files' bytes: what a refused call must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_uploads_are_refused_with_nothing_written(exported, case):
    engine, files = exported
    before = _tree(engine.store.root)
    for key in (f"bad-run/sampler_weights/{case.replace(' ', '-')}", f"run-a/sampler_weights/{case.replace(' ', '-')}"):
        # a new run's first checkpoint, and one more of a run that has checkpoints: no <run>/ or <run>/<kind>/ left either
        with pytest.raises(InvalidArgument):
            engine.import_checkpoint(key, BAD[case](files))
        assert _tree(engine.store.root) == before, key


def test_deleting_a_runs_last_checkpoint_leaves_no_empty_folders(exported):
    engine, files = exported
    before = _tree(engine.store.root)
    engine.import_checkpoint("undone-run/sampler_weights/x", files)
    engine.import_checkpoint("undone-run/weights/x", files)
    assert engine.store.delete("undone-run/sampler_weights/x") and engine.store.delete("undone-run/weights/x")
    assert _tree(engine.store.root) == before  # as an import undone by the scheduler leaves it
