"""A save's size is known before it is written (issue 21, edge 7): SaveAdapter(measure_only) answers
exactly the bytes the save then writes, and writes nothing."""

import numpy as np

from temper.common.validation import DecodedDatum
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import AdamParams, ForwardBackwardItem, OptimStepItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings


def test_measured_bytes_are_the_written_bytes_and_measuring_writes_nothing(tiny_model_dir, tmp_path):
    engine = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(checkpoint_dir=tmp_path / "ckpt"))
    engine.create_adapter("r", AdapterSpec(rank=4, alpha=8.0, targets=lora_targets(attn=True, mlp=True, unembed=False)), seed=1)
    tokens = np.arange(1, 9)
    datum = DecodedDatum(tokens=tokens[:-1].astype(np.int32), inputs={"target_tokens": tokens[1:].astype(np.int64),
                                                                     "weights": np.ones(7, np.float32)})
    for stepped in (False, True):  # a training checkpoint grows by the Adam moments after the first step
        if stepped:
            engine.run_cycle([ForwardBackwardItem("r", [datum])], [OptimStepItem("r", AdamParams(learning_rate=1e-3))])
        for kind, optimizer in (("sampler_weights", False), ("weights", True)):
            key = f"r/{kind}/{int(stepped)}"
            before = sorted((tmp_path / "ckpt").rglob("*"))
            measured = engine.save("r", key, optimizer, measure_only=True)
            assert sorted((tmp_path / "ckpt").rglob("*")) == before  # nothing written, no folder made
            written = engine.save("r", key, optimizer)
            on_disk = sum(f.stat().st_size for f in engine.store.existing(key).iterdir())
            assert measured == written == on_disk > 0
