"""A trainer group checks its layout on the folder its weights load from (services/trainer/group.py):
the embedded SmolLM2's name, as docker-compose.yml's sharded profile gives it, is no hub id to fetch
(a compose trainer sits on a network with no route out)."""

import shutil

from transformers import AutoConfig

from temper.services.models.prepare import SMOLLM2_NAME, smollm2_dir
from temper.services.trainer import group
from temper.services.trainer.settings import TrainerSettings


def test_check_layout_reads_the_prepared_folder_of_a_named_model(tiny_model_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_model_dir, smollm2_dir(tmp_path))  # as temper-prepare-model leaves the model cache
    monkeypatch.setenv("TEMPER_MODEL_CACHE", str(tmp_path))
    read = []
    load = AutoConfig.from_pretrained
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda name, *args, **kwargs: read.append(name) or load(name, *args, **kwargs))
    group.check_layout(TrainerSettings(base_model=SMOLLM2_NAME, world_size=2, internal_auth="disabled"))
    assert read == [str(smollm2_dir(tmp_path))]
