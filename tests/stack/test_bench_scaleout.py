"""The benchmark scripts of scale-out, one scheduler and replicas still run end to end and write every figure they promise
(bench_scripts.py says how; one file per theme so the test workers share them out)."""

from __future__ import annotations

import json

import pytest

from bench_scripts import run_script


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
