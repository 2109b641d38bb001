"""`make demo` end to end on the tiny model (a couple of steps): it must run through the client
against the three-process stack and leave the JSON summary, metrics and a loss-curve PNG."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "examples.trajectory_judge.demo", "--base-model", tiny_model_dir, "--steps", "2",
         "--max-heldout", "4", "--threads", "1", "--out-dir", str(out), "--data-dir", str(tmp_path / "data")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["heldout"] == 4
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["seconds"] > 0 and summary["dtype"] == "bfloat16"
    assert set(summary["phase_seconds"]) == {"start", "eval_before", "train", "save_and_eval_after"}
    assert "TINKER_BASE_URL=http://127.0.0.1:" in proc.stderr and "TINKER_API_KEY=tml-" in proc.stderr  # the gateway ran
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)
    assert len((out / "heldout_predictions.jsonl").read_text().splitlines()) == 4


def test_judge_data_is_balanced_and_heldout_is_unseen():
    from examples.trajectory_judge.data import load_heldout, load_train

    train, heldout = load_train(), load_heldout()
    for split in (train, heldout):
        assert sum(ex["better"] == "A" for ex in split) * 2 == len(split)
    assert not {ex["task"] for ex in train} & {ex["task"] for ex in heldout}
    hard = {"polish_vs_correct", "claim_no_receipt"}
    assert sum(ex["kind"] in hard for ex in heldout) * 2 >= len(heldout)


def test_batches_cover_each_epoch_once_in_a_fresh_order():
    import random

    from examples.trajectory_judge.demo import epoch_batches

    batches = epoch_batches(10, 4, 6, random.Random(0))  # 24 picks: two whole epochs, then 4 of a third
    assert [len(b) for b in batches] == [4] * 6
    picks = [i for b in batches for i in b]
    assert sorted(picks[:10]) == list(range(10)) and sorted(picks[10:20]) == list(range(10))
    assert picks[:10] != picks[10:20]
