"""`python -m examples.shape_colour.demo` end to end on the tiny Qwen3-VL-MoE (a few steps; its 4,096-entry
vocabulary build, fixture small_vocab_vl_model: the demo finds its special tokens by text): uploads,
pointer prompts scored with compute_logprobs, ImageChunk training, the summary, metrics, predictions and
the loss-curve PNG. (The full run's accuracy is recorded in docs/measured.md; the unmodified cookbook
recipe's >= 0.9 is asserted in test_cookbook_vlm.py.)"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_shape_colour_example_runs_on_the_tiny_vlm(small_vocab_vl_model, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "examples.shape_colour.demo", "--base-model", small_vocab_vl_model,
         "--steps", "3", "--train", "12", "--heldout", "6", "--out-dir", str(out), "--data-dir", str(tmp_path / "data")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["heldout"] == 6 and summary["image_tokens"] == 4
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["loss_last"] < summary["loss_first"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    predictions = [json.loads(line) for line in (out / "heldout_predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 6 and all(p["chosen"] in summary["answers"] for p in predictions)


def test_colour_examples_are_balanced_pngs():
    from examples.shape_colour.data import ANSWERS, make_examples

    examples = make_examples(12, seed=3)
    assert sorted(ex.answer for ex in examples) == sorted(ANSWERS * 2)
    assert all(ex.png.startswith(b"\x89PNG\r\n\x1a\n") for ex in examples)
    assert make_examples(12, seed=3) == examples and make_examples(12, seed=4) != examples
