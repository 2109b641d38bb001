"""The benchmark scripts of recovery after kills still run end to end and write every figure they promise
(bench_scripts.py says how; one file per theme so the test workers share them out)."""

from __future__ import annotations

import json

from bench_scripts import run_script


def test_recovery_benchmark_runs_and_reports_every_figure(tiny_model_dir, tmp_path):
    result = run_script("recovery.py", "--model", tiny_model_dir, "--rounds", "3", "--every", "2", "--rows", "1", "--tokens", "8",
                        "--rank", "2", "--threads", "1", "--dispatch-retry", "1", "--out-dir", str(tmp_path))
    assert result["benchmark"] == "recovery"
    snapshot = result["snapshot"]
    assert snapshot["snapshots"] >= 1 and snapshot["snapshot_fraction"] > 0 and len(snapshot["round_seconds"]["on"]["samples"]) == 3
    assert result["same_address"]["death_to_training_s"] > 0 and result["same_address"]["restore_s"] > 0
    assert result["other_trainer"]["failover_s"] > 0 and result["other_trainer"]["restore_s"] > 0
    assert json.loads((tmp_path / "recovery.json").read_text())["snapshot"] == snapshot
