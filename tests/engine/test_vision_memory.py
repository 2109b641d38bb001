"""The activation memory estimate with images (services/trainer/memory.py ``TowerShape``) on the tiny
Qwen3-VL models: what autograd saves inside the vision tower in one engine pass against the estimate,
images in the pass plan, and ``python -m temper.plan`` counting image tokens and the tower."""

from __future__ import annotations

import json

import numpy as np
import pytest

from temper.services.lora.model import AdapterSpec
from temper.services.trainer.numerics import PassOptions, Row, plan_passes

from tests.engine.test_memory_families import saved_bytes
from tests.engine.test_vision_trainer import datum, item, make_engine, noise_png, run_wire

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RANK, ROWS, TEXT = 16, 4, 40


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_saved_tower_activations_match_the_estimate(vl_model_dirs, tmp_path, family):
    """One stored pass of 4 rows, each a 128 x 128 image (16 tokens, 64 patches) and 42 text tokens,
    one adapter training the tower at rank 16: what the tower saves is the estimate's count (measured
    1.14 of it on both families: the LayerNorms' float32 statistics and the rotary tables are not counted)."""
    engine = make_engine(vl_model_dirs[family], tmp_path, activation_checkpointing=False)
    spec = AdapterSpec(rank=RANK, alpha=8.0, targets=engine.lora.group_targets(attn=True, mlp=True, vision=True))
    engine.create_adapter("run-a", spec, seed=1)
    vision = engine.loaded.vision
    rows = [datum(vision, [[1, 2], noise_png(n, (128, 128)), [3] * TEXT], n, 2 + 18 + TEXT) for n in range(ROWS)]
    measured = saved_bytes(engine.loaded.model, [engine.loaded.model.model.visual],
                           lambda: run_wire(engine, [item("run-a", rows)]))
    tower = engine.activations.tower
    assert (tower.merge, tower.depth, tower.deepstack) == (4, 2, 1)
    estimated = tower.trained_elements(ROWS * 16, RANK) * engine.activations.dtype_bytes
    assert 0.8 <= measured / estimated <= 1.25, (measured, estimated)


def test_images_count_in_the_pass_bytes_and_the_pass_plan(vl_model_dirs, tmp_path):
    engine = make_engine(vl_model_dirs["qwen3_vl"], tmp_path)
    act = engine.activations
    text_only = act.pass_bytes(256, 64, False, 64)
    cached = act.pass_bytes(256, 64, False, 64, image_tokens=64)
    trained = act.pass_bytes(256, 64, False, 64, image_tokens=64, trained_image_tokens=64)
    assert text_only < cached < trained
    assert cached - text_only == pytest.approx(act.overhead * 64 * 2 * act.hidden * act.dtype_bytes)  # embedding + deepstack
    # checkpointed, a trained tower's layers count only where they outweigh the decoder's stored inputs
    assert act.pass_bytes(256, 64, True, 64, 64, 64) < trained

    class Datum:
        def __init__(self, n):
            self.tokens = np.zeros(n, np.int32)

    budget = act.pass_bytes(4 * 64, 64, False, 64, 4 * 16, 0)
    options = PassOptions(0, 64, activations=act, activation_budget=int(budget) + 1, checkpointing=False)
    plain = [Row(0, n, Datum(64), image_tokens=16) for n in range(4)]
    tuned = [Row(0, n, Datum(64), image_tokens=16, tower_trained=True) for n in range(4)]
    assert [len(batch) for batch, _ in plan_passes(plain, options)] == [4]
    assert len(list(plan_passes(tuned, options))) > 1   # the trained tower's activations split the pass


def test_plan_counts_image_tokens_and_the_vision_tower(vl_model_dirs, capsys):
    from temper.plan import main

    def plan(*extra) -> dict:
        assert main(["--model", vl_model_dirs["qwen3_vl_moe"], "--devices", "cpu:2x8GiB", "--tokens", "512",
                     "--dtype", "float32", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    text, images, tuned = plan(), plan("--images", "8", "--image-tokens", "16"), plan("--images", "8", "--image-tokens",
                                                                                      "16", "--train-vision")
    stored = [p["layouts"][0]["stored_bytes"] for p in (text, images, tuned)]
    assert stored[0] < stored[1] < stored[2]
    assert tuned["counts"]["lora_linear_params"] > images["counts"]["lora_linear_params"]
    assert "takes no images" in " ".join(images["layouts"][1]["notes"]) and not text["layouts"][1]["notes"]
    assert main(["--model", vl_model_dirs["qwen3_vl"], "--devices", "1x8GiB", "--images", "100", "--image-tokens", "100",
                 "--tokens", "512"]) == 2
