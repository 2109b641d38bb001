"""Fixtures shared by the engine tests of the model families (tests/engine/test_families.py,
test_moe_*.py, test_memory_families.py)."""

from pathlib import Path

import pytest
import torch

from temper.services.models.tiny import TINY_FAMILIES, build_tiny_model


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: intra-op threads only spin (and crawl on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny random model folder of every family (services/models/tiny.py), built once per session."""
    root = tmp_path_factory.mktemp("families").resolve()
    return {family: build_tiny_model(root / family, family=family) for family in TINY_FAMILIES}


def random_adapter_folders(model_dir, tmp_path_factory, specs: dict, scale: float, seed: int) -> dict:
    """Each spec's LoRA adapter with weights drawn from N(0, scale) (seeded), saved as a peft folder:
    adapters that visibly change the model's outputs."""
    from temper.services.lora.model import LoraModel
    from temper.services.models.loading import load_model

    scratch = LoraModel(load_model(model_dir).model, model_dir)
    out = {}
    for i, (key, spec) in enumerate(specs.items()):
        scratch.add(key, spec, seed=i)
        with torch.no_grad():
            for p in scratch.adapters[key].params.values():
                p.normal_(0, scale, generator=torch.Generator().manual_seed(seed + i))
        out[key] = tmp_path_factory.mktemp(f"adapter-{i}")
        scratch.save(key, out[key])
    return out

