"""The benchmark scripts of the deterministic mode still run end to end and write every figure they promise
(bench_scripts.py says how; one file per theme so the test workers share them out)."""

from __future__ import annotations

from bench_scripts import run_script


def test_deterministic_benchmark_runs_the_real_backends_and_checks_equal_bits(tiny_model_dir, tmp_path):
    result = run_script("deterministic.py", "--model", tiny_model_dir, "--reps", "1", "--new-tokens", "4",
                        "--out-dir", str(tmp_path))
    assert result["training_ratio"] > 0 and result["decode_ratio"] > 0
    decode = result["decode"]
    assert all(made == [decode["generated_tokens_per_call"]] for made in decode["generated_tokens_checked"].values())
    assert decode["generated_tokens_per_call"] == 4 * 2 * 4  # 4 requests x 2 samples x 4 tokens, on both sides
    assert result["equal_bits"]["all_equal"] is True, result["equal_bits"]
    assert (tmp_path / "deterministic.png").read_bytes()[:4] == b"\x89PNG"
