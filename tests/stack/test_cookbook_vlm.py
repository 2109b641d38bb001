"""tinker-cookbook 0.6.1's `recipes.vlm_classifier`, unmodified, against `make serve` (python -m temper.serve)
on the tiny Qwen3-VL-MoE in its 4,096-entry-vocabulary build (fixture small_vocab_vl_model: with the real
151,936-row head each of the 96 steps took about 20x longer, for the same task): train, then eval, on an
offline imagefolder of coloured shapes that the test writes (tests/stack/vlm_shapes.py, which also
registers it in the recipe's dataset and evaluator tables: nothing of the recipe changes). The recipe renders
each image with the cookbook's own Qwen3-VL renderer (`qwen3_vl_instruct`: an ImageChunk with expected_tokens
from the model's image processor, loaded from the model folder given as `model_name`) and sends it through
the official SDK.

Held-out accuracy goes from chance (the recipe's evaluator at step 0, in metrics.jsonl) to >= 0.9 (the
recipe's `eval` entry point on the final sampler checkpoint). Offline as the other cookbook tests are."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_process import ServeProcess

HERE = Path(__file__).resolve().parent
RECIPE_TIMEOUT = 900
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_vlm(small_vocab_vl_model, tmp_path_factory):
    with ServeProcess(small_vocab_vl_model, tmp_path_factory.mktemp("serve-vlm")) as served:
        yield served


def run_recipe(served, cwd: Path, shapes: Path, *argv: str) -> str:
    env = {**os.environ, "TINKER_BASE_URL": served.http, "TINKER_API_KEY": served.api_key, "TINKER_TELEMETRY": "0",
           "TEMPER_SHAPES_DIR": str(shapes), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cwd / "hf-datasets"),
           "HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    proc = subprocess.run([sys.executable, str(HERE / "vlm_shapes.py"), *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace", timeout=RECIPE_TIMEOUT)
    assert proc.returncode == 0, f"vlm_shapes.py {' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def test_vlm_classifier_trains_from_chance_to_090_heldout(served_vlm, small_vocab_vl_model, tmp_path):
    from vlm_shapes import COLOURS, make_dataset

    shapes = make_dataset(tmp_path / "shapes")
    model = small_vocab_vl_model
    log_root = tmp_path / "runs"
    out = run_recipe(served_vlm, tmp_path, shapes, "train", f"experiment_dir={log_root}", "dataset=shapes",
                     f"model_name={model}", "renderer_name=qwen3_vl_instruct", "behavior_if_log_dir_exists=delete",
                     "batch_size=16", "learning_rate=3e-3", "lr_schedule=constant", "num_epochs=12", "lora_rank=16", "eval_every=1000",
                     "save_every=1000", "n_eval=32", "max_tokens=12", "run_nll_evaluator=False")
    assert "Training completed successfully" in out, out[-3000:]
    (log_path,) = [p for p in log_root.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accuracy_keys = [k for k in rows[0] if k.endswith("accuracy")]
    assert accuracy_keys, f"no accuracy at step 0 in {sorted(rows[0])}"
    before = rows[0][accuracy_keys[0]]
    assert before <= 1.5 / len(COLOURS), f"accuracy before training {before}: not chance"
    losses = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert losses[-1] < losses[0] / 4, losses

    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    final = [c["sampler_path"] for c in checkpoints if c.get("sampler_path")][-1]
    out = run_recipe(served_vlm, tmp_path, shapes, "eval", "dataset=shapes", f"model_path={final}",
                     f"model_name={model}", "renderer_name=qwen3_vl_instruct", "n_eval=32", "max_tokens=12")
    line = [ln for ln in out.splitlines() if ln.startswith("Metrics = ")][-1]
    after = ast.literal_eval(line.removeprefix("Metrics = "))  # the recipe prints a dict of floats
    assert after["accuracy"] >= 0.9, f"held-out accuracy {after} (before: {before})"
