"""The benchmark scripts of asynchronous RL still run end to end and write every figure they promise
(bench_scripts.py says how; one file per theme so the test workers share them out)."""

from __future__ import annotations

from bench_scripts import run_script


def test_async_rl_benchmark_runs_both_recipes_and_reports_every_figure(tiny_model_dir, tmp_path):
    result = run_script("async_rl.py", "--model", tiny_model_dir, "--quick", "--out-dir", str(tmp_path))
    assert result["steps_per_hour_ratio"] > 0 and result["sync"]["steps_per_hour"] > 0 and result["async"]["steps_per_hour"] > 0
    # a save after each step that trained (with --quick's parity reward, a step whose groups all score alike does not)
    assert 1 <= result["switch"]["versions_saved"] <= 3 and result["switch"]["versions_seen"] >= 1, result["switch"]
    assert result["switch_ratio"] > 0 and all(s >= 0 for s in result["switch"]["latencies_s"])
    assert 0.0 <= result["prefix_cache"]["async_run_hit_rate"] <= 1.0
    group = result["prefix_cache"]["group_as_requests"]
    assert len(group["hit_tokens"]) == 4 and group["hit_tokens"][0] == 0
    assert isinstance(result["heldout"]["equal_within_noise"], bool)
    assert (tmp_path / "async_rl.json").exists() and (tmp_path / "async_rl.png").read_bytes()[:4] == b"\x89PNG"
