"""The benchmark scripts of checkpointing and publishing still run end to end and write every figure they promise
(bench_scripts.py says how; one file per theme so the test workers share them out)."""

from __future__ import annotations

import json

from bench_scripts import run_script


def test_checkpointing_benchmark_runs(tiny_model_dir, tmp_path):
    result = run_script("checkpointing.py", "--model", tiny_model_dir, "--tokens", "16", "--reps", "1", "--threads", "1",
                        "--out-dir", str(tmp_path))
    assert result["time_ratio"] > 0 and result["memory_ratio"] > 0
    assert len(result["samples_s"]["on"]) == len(result["samples_s"]["off"]) == 1


def test_publish_benchmark_runs_and_reports_the_fraction(tiny_model_dir, tmp_path):
    result = run_script("publish.py", "--model", tiny_model_dir, "--rounds", "2", "--rows", "1", "--tokens", "8", "--rank", "2",
                        "--threads", "1", "--out-dir", str(tmp_path))
    assert result["benchmark"] == "publish" and len(result["rounds"]) == 2
    assert result["step_s_median"] > 0 and result["fraction"] >= 0 and result["save_s_median"] > 0
    assert all(r["first_sample_s"] >= r["save_s"] for r in result["rounds"])
    assert json.loads((tmp_path / "publish.json").read_text())["fraction"] == result["fraction"]
