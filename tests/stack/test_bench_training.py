"""The benchmark scripts of multitenant (the co-batching ratios), the co-batch sweep and the MoE benchmark still run end to end and write every figure they promise
(bench_scripts.py says how; one file per theme so the test workers share them out)."""

from __future__ import annotations

import json

from bench_scripts import run_script


def test_multitenant_benchmark_runs_and_reports_every_ratio(tiny_model_dir, tmp_path):
    result = run_script("multitenant.py", "--model", tiny_model_dir, "--quick", "--reps", "1", "--no-stack",
                        "--memory-tokens", "16", "--threads", "1", "--out-dir", str(tmp_path))
    ratios = result["ratios"]
    assert ratios["scheduler_overhead"] is None  # --no-stack
    for name in ("cobatch_overhead", "cobatch_gain", "memory_ratio"):
        assert ratios[name] > 0, name
    assert result["memory"]["chunked"]["activation_checkpointing"] is True
    from temper.common.host_allocator import TUNED_MALLOC_ENV, is_glibc_linux

    if is_glibc_linux():  # the timed variants ran under the trainer's allocator settings, (d) did not
        assert result["config"]["malloc_env"] == TUNED_MALLOC_ENV
        assert result["memory"]["chunked"]["malloc_mmap_threshold"] == "65536"
    assert (tmp_path / "multitenant.json").exists() and (tmp_path / "multitenant.png").read_bytes()[:4] == b"\x89PNG"


def test_cobatch_sweep_runs(tiny_model_dir, tmp_path):
    result = run_script("cobatch_sweep.py", "--model", tiny_model_dir, "--tokens", "8", "16", "--reps", "1", "--threads", "1",
                        "--out-dir", str(tmp_path))
    assert [p["tokens_per_tenant"] for p in result["points"]] == [8, 16]
    assert all(p["cobatch_gain"] > 0 and len(p["samples_s"]["cobatched"]) == 1 for p in result["points"])
    assert (tmp_path / "cobatch_sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_moe_benchmark_runs_and_reports_every_field(tmp_path):
    # a tiny qwen3_moe (8 experts, top-2) built by the script; fields only, not timings
    result = run_script("moe.py", "--hidden", "64", "--layers", "2", "--tokens", "8", "--reps", "1", "--quick",
                        "--out-dir", str(tmp_path))
    assert result["benchmark"] == "moe" and set(result["goals"]) == {"cobatch_overhead", "cobatch_gain"}
    for field in ("ratios", "ratios_cpu_time", "ratios_with_optim_step", "goal_met", "goal_met_with_optim_step", "spread"):
        assert set(result[field]) == {"cobatch_overhead", "cobatch_gain"}, field
    assert all(v > 0 for v in result["ratios"].values())
    assert set(result["samples_s"]) == {"cobatched", "single_adapter", "time_sliced"}
    assert all(len(s["forward_backward"]) == len(s["optim_step"]) == 1 for s in result["samples_s"].values())
    assert set(result["profile"]) == {"cobatched", "single_adapter"}
    assert all(p["pieces"] and p["total_ms"] > 0 for p in result["profile"].values())
    pieces = result["profile"]["cobatched"]["pieces"]  # the experts.py methods were found and wrapped
    # the LoRA matmuls of one of the two paths (small slices: per expert, adapters side by side)
    assert any("_Bucket.deltas" in label or "_Bucket.expert_deltas" in label for label in pieces)
    assert "frozen expert matmuls" in pieces
    config = result["config"]
    assert config["experts"] == 8 and config["top_k"] == 2 and config["expert_rank"] == 4 and config["threads"] == 1
    assert "mlp.experts.gate_up_proj" in config["targets"]
    assert json.loads((tmp_path / "moe.json").read_text())["ratios"] == result["ratios"]
    assert (tmp_path / "moe.png").read_bytes()[:4] == b"\x89PNG"
