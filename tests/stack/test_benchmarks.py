"""The CPU benchmark scripts still run end to end (tiny model, one repetition, tiny memory pass) and
write every ratio they promise. Their figures are not checked here: timings belong to benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def test_checkpointing_benchmark_runs(tiny_model_dir, tmp_path):
    result = run_script("checkpointing.py", "--model", tiny_model_dir, "--tokens", "16", "--reps", "1", "--threads", "1",
                        "--out-dir", str(tmp_path))
    assert result["time_ratio"] > 0 and result["memory_ratio"] > 0
    assert len(result["samples_s"]["on"]) == len(result["samples_s"]["off"]) == 1


def test_cobatch_sweep_runs(tiny_model_dir, tmp_path):
    result = run_script("cobatch_sweep.py", "--model", tiny_model_dir, "--tokens", "8", "16", "--reps", "1", "--threads", "1",
                        "--out-dir", str(tmp_path))
    assert [p["tokens_per_tenant"] for p in result["points"]] == [8, 16]
    assert all(p["cobatch_gain"] > 0 and len(p["samples_s"]["cobatched"]) == 1 for p in result["points"])
    assert (tmp_path / "cobatch_sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_deterministic_benchmark_runs_the_real_backends_and_checks_equal_bits(tiny_model_dir, tmp_path):
    result = run_script("deterministic.py", "--model", tiny_model_dir, "--reps", "1", "--new-tokens", "4",
                        "--out-dir", str(tmp_path))
    assert result["training_ratio"] > 0 and result["decode_ratio"] > 0
    decode = result["decode"]
    assert all(made == [decode["generated_tokens_per_call"]] for made in decode["generated_tokens_checked"].values())
    assert decode["generated_tokens_per_call"] == 4 * 2 * 4  # 4 requests x 2 samples x 4 tokens, on both sides
    assert result["equal_bits"]["all_equal"] is True, result["equal_bits"]
    assert (tmp_path / "deterministic.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_benchmark_smoke_runs_on_the_trainer_numerics_without_grpc_protobuf_or_pydantic():
    # as on a GPU box without temper installed: the shim + torch/transformers only
    code = ("import runpy, sys\n"
            "sys.argv = ['gpu_multitenant.py', '--smoke']\n"
            "try:\n    runpy.run_path(sys.argv_path, run_name='__main__')\n"
            "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'pydantic', 'pydantic_settings')"
            " or m.startswith(('google.protobuf', 'temper.v1', 'temper.common'))))\n")
    code = code.replace("sys.argv_path", repr(str(REPO / "benchmarks" / "gpu_multitenant.py")))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "LOADED []"
    result = json.loads(lines[-2])
    assert result["ratios"]["cobatch_gain"] > 0 and result["config"]["numerics_module"].endswith("services/trainer/numerics.py")


def test_scaleout_benchmark_quick_runs_against_a_real_scheduler_and_reports_every_field(postgres_server_url, tmp_path):
    # a real scheduler process per stack on fresh Postgres databases, fake trainers over gRPC
    result = run_script("scaleout.py", "--quick", "--durable-floor", "--database-url", postgres_server_url, "--out-dir", str(tmp_path))
    assert result["benchmark"] == "scaleout"
    assert result["errors"]["count"] == 0, result["errors"]
    throughput = result["throughput"]
    counts = [str(n) for n in throughput["trainers"]]
    assert counts == ["1", "2"]
    for field in ("ratios", "tokens_per_s", "goal_met", "efficiency", "trainer_busy_fraction", "scheduler_cores",
                  "verbs_fraction_of_ceiling"):
        assert set(throughput[field]) == set(counts), field
    assert all(throughput["tokens_per_s"][n] > 0 for n in counts) and throughput["ratios"]["1"] == 1.0
    for n in counts:  # every run was answered, by one of the stack's trainers
        seen = throughput["runs_per_trainer_seen"][n]
        assert set(seen) <= {str(t) for t in range(int(n))} and sum(seen.values()) == int(n) * result["config"]["runs_per_trainer"]
    ceiling = result["ceiling"]
    assert ceiling["verbs_per_s"] > 0 and len(ceiling["samples_verbs_per_s"]) == result["config"]["reps"]
    # the bare gRPC server, driven side by side: the ceiling as a fraction of it
    assert len(ceiling["grpc_floor_samples_verbs_per_s"]) == result["config"]["reps"] and ceiling["grpc_floor_verbs_per_s"] > 0
    assert ceiling["fraction_of_grpc_floor"] == pytest.approx(ceiling["verbs_per_s"] / ceiling["grpc_floor_verbs_per_s"])
    # and the durable floor (each verb written twice to its own Postgres database), side by side too
    assert len(ceiling["durable_floor_samples_verbs_per_s"]) == result["config"]["reps"] and ceiling["durable_floor_verbs_per_s"] > 0
    assert ceiling["ceiling_fraction_of_durable_floor"] == pytest.approx(ceiling["verbs_per_s"] / ceiling["durable_floor_verbs_per_s"])
    assert ceiling["durable_floor_cores"]["database"] > 0  # its writes reached Postgres
    latency = result["latency"]
    assert abs(latency["target_verbs_per_s"] - result["config"]["latency_fraction"] * ceiling["verbs_per_s"]) < 1e-6
    for verb in ("forward_backward", "optim_step", "all"):
        added = latency["per_verb"][verb]["added_ms"]
        assert added["n"] > 0 and added["p50"] is not None and added["p99"] >= added["p50"], verb
    saved = json.loads((tmp_path / "scaleout.json").read_text())
    assert saved["throughput"]["ratios"] == throughput["ratios"]
    assert (tmp_path / "scaleout.png").read_bytes()[:4] == b"\x89PNG"


def test_scaleout_replicas_quick_reports_every_field(postgres_server_url, tmp_path):
    # two real scheduler replicas on one fresh Postgres database against one, then the lane owner's SIGKILL
    result = run_script("scaleout.py", "--replicas", "2", "--quick", "--database-url", postgres_server_url, "--out-dir", str(tmp_path))
    assert result["benchmark"] == "scaleout-replicas" and result["replicas"] == 2
    assert result["errors"]["count"] == 0, result["errors"]
    reps = result["config"]["reps"]
    for side in ("one", "many", "direct"):
        got = result[side]
        assert got["verbs_per_s"] > 0 and len(got["samples_verbs_per_s"]) == reps, side
        assert got["scheduler_cpu_ms_per_verb"] > 0 and got["database_cpu_ms_per_verb"] > 0, side
        assert all(got["cores"][k] is not None for k in ("scheduler", "database", "client", "workers")), side
    many = result["many"]
    assert many["cores"]["scheduler-0"] > 0 and many["cores"]["scheduler-1"] > 0
    assert many["cores"]["scheduler"] == pytest.approx(many["cores"]["scheduler-0"] + many["cores"]["scheduler-1"], rel=0.25)
    # both replicas hold lanes and runs, and round_robin sent some lane verbs to the replica that does not own them
    assert len(many["lanes_per_replica"]) == 2 and all(n >= 1 for n in many["lanes_per_replica"].values())
    assert sum(many["runs_per_replica"].values()) == result["config"]["ceiling_runs"]
    assert 0 < many["forwarded_fraction"] < 1 and many["expected_forwarded_fraction"] == 0.5
    assert result["direct"]["forwarded_fraction"] == 0  # each run sent straight to its lane's owner: nothing forwarded
    ratios = result["ratios"]
    assert ratios["scheduler_cpu_per_verb"] == pytest.approx(many["scheduler_cpu_ms_per_verb"] / result["one"]["scheduler_cpu_ms_per_verb"])
    assert ratios["verbs_per_s"] == pytest.approx(many["verbs_per_s"] / result["one"]["verbs_per_s"])
    assert ratios["direct_scheduler_cpu_per_verb"] == pytest.approx(
        result["direct"]["scheduler_cpu_ms_per_verb"] / result["one"]["scheduler_cpu_ms_per_verb"])
    assert ratios["one_scheduler_cpu_per_verb_over_durable_floor"] > 0 and ratios["extra_scheduler_cpu_ms_per_forwarded_verb"] is not None
    assert set(result["goals"]) == {"scheduler_cpu_per_verb", "hinted_scheduler_cpu_per_verb", "failover_s", "one_over_durable_floor"}
    assert result["hinted"]["forwarded_fraction"] < many["forwarded_fraction"]  # owner hints: runs' verbs go to their owner
    assert ratios["hinted_scheduler_cpu_per_verb"] == pytest.approx(
        result["hinted"]["scheduler_cpu_ms_per_verb"] / result["one"]["scheduler_cpu_ms_per_verb"])
    # the single replica's ceiling against the bare and the durable floor, side by side as before
    ceiling = result["ceiling"]
    assert ceiling["grpc_floor_verbs_per_s"] > 0 and ceiling["durable_floor_verbs_per_s"] > 0 and ceiling["verbs_per_s"] > 0
    # the SIGKILLed replica's runs were all answered again, by the survivor, which took its lanes
    failover = result["failover"]
    assert failover["lease_seconds"] == result["config"]["lease_seconds"] and failover["lanes"] and failover["runs"] > 0
    assert failover["unanswered_runs"] == 0 and failover["errors"] == 0
    assert len(failover["next_answer_s"]["per_run"]) == failover["runs"] and failover["lanes_taken_s"] > 0
    assert failover["next_answer_s"]["max"] >= failover["next_answer_s"]["median"] > 0
    saved = json.loads((tmp_path / "scaleout-replicas.json").read_text())
    assert saved["ratios"] == ratios
    assert (tmp_path / "scaleout-replicas.png").read_bytes()[:4] == b"\x89PNG"


def test_recovery_benchmark_runs_and_reports_every_figure(tiny_model_dir, tmp_path):
    result = run_script("recovery.py", "--model", tiny_model_dir, "--rounds", "3", "--every", "2", "--rows", "1", "--tokens", "8",
                        "--rank", "2", "--threads", "1", "--dispatch-retry", "1", "--out-dir", str(tmp_path))
    assert result["benchmark"] == "recovery"
    snapshot = result["snapshot"]
    assert snapshot["snapshots"] >= 1 and snapshot["snapshot_fraction"] > 0 and len(snapshot["round_seconds"]["on"]["samples"]) == 3
    assert result["same_address"]["death_to_training_s"] > 0 and result["same_address"]["restore_s"] > 0
    assert result["other_trainer"]["failover_s"] > 0 and result["other_trainer"]["restore_s"] > 0
    assert json.loads((tmp_path / "recovery.json").read_text())["snapshot"] == snapshot


def test_publish_benchmark_runs_and_reports_the_fraction(tiny_model_dir, tmp_path):
    result = run_script("publish.py", "--model", tiny_model_dir, "--rounds", "2", "--rows", "1", "--tokens", "8", "--rank", "2",
                        "--threads", "1", "--out-dir", str(tmp_path))
    assert result["benchmark"] == "publish" and len(result["rounds"]) == 2
    assert result["step_s_median"] > 0 and result["fraction"] >= 0 and result["save_s_median"] > 0
    assert all(r["first_sample_s"] >= r["save_s"] for r in result["rounds"])
    assert json.loads((tmp_path / "publish.json").read_text())["fraction"] == result["fraction"]


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
