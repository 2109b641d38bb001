"""A trainer group's bad input and faults (issue 20, services/trainer/group.py), local processes on gloo.

* A layout the model cannot take refuses to start, before any weights load, with one line naming the
  numbers (``python -m temper.services.trainer``). FSDP2 alone accepts any world size >= 1 (every
  parameter is sharded on dim 0, the last shard padded), so what can fail is the model catalogue's
  layout at that world size: routed experts placed per rank that do not divide over the ranks, or a
  catalogue whose ``ranks_per_trainer`` is not the group's world size.
* A rank that never joins: rank 0 alone exits GROUP_FAILED after the group timeout, naming the missing
  rank and the timeout; it does not hang.
* A network partition (a peer frozen with SIGSTOP: its sockets stay open, nothing answers, as when the
  network between the hosts drops packets): rank 0 exits GROUP_FAILED within the group timeout plus
  the heartbeat's period (plus slack), both while idle (the heartbeat's round trip) and inside a cycle
  (the collectives' timeout).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp

from free_ports import free_port
from temper.services.trainer.group import GROUP_FAILED

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 3.0  # the group timeout of these tests
SLACK = 3.0    # process scheduling, gloo's own polling, os._exit


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    from temper.services.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("group-edges").resolve()
    return {family: build_tiny_model(root / family, family=family) for family in ("qwen3", "qwen3_moe")}


def trainer(tmp_path: Path, folder: Path, **env) -> subprocess.Popen:
    """``python -m temper.services.trainer`` as one rank (settings from TEMPER_TRAINER_*)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_")}
    full.update({"TEMPER_TRAINER_BASE_MODEL": str(folder), "TEMPER_TRAINER_INTERNAL_AUTH": "disabled",
                 "TEMPER_TRAINER_NUM_THREADS": "1", "TEMPER_TRAINER_BIND": "127.0.0.1:0",
                 "TEMPER_TRAINER_METRICS_BIND": "127.0.0.1:0", "TEMPER_TRAINER_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                 "TEMPER_TRAINER_OFFLOAD_DIR": str(tmp_path / "offload"), "PYTHONUNBUFFERED": "1"})
    full.update(env)
    return subprocess.Popen([sys.executable, "-m", "temper.services.trainer"], cwd=tmp_path, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_layout_the_model_cannot_take_refuses_to_start_naming_the_numbers(tiny_dirs, tmp_path):
    moe, dense = str(tiny_dirs["qwen3_moe"]), str(tiny_dirs["qwen3"])
    cases = {  # name: (model, env, what the one line says)
        "experts": (moe, {"TEMPER_TRAINER_WORLD_SIZE": "3", "TEMPER_MODEL_CATALOGUE": json.dumps(
            {moe: {"ranks_per_trainer": 3, "experts_per_rank": True}})},
            "8 routed experts do not divide over ranks_per_trainer=3 (experts placed per rank: 8 % 3 = 2)"),
        "no experts": (dense, {"TEMPER_TRAINER_WORLD_SIZE": "2", "TEMPER_MODEL_CATALOGUE": json.dumps(
            {dense: {"ranks_per_trainer": 2, "experts_per_rank": True}})},
            "experts_per_rank is for mixture-of-experts models"),
        "catalogue": (dense, {"TEMPER_TRAINER_WORLD_SIZE": "2", "TEMPER_MODEL_CATALOGUE": json.dumps(
            {dense: {"ranks_per_trainer": 4}})},
            "TEMPER_TRAINER_WORLD_SIZE=2 but the model catalogue lays this model out over ranks_per_trainer=4"),
        "rank": (dense, {"TEMPER_TRAINER_WORLD_SIZE": "2", "TEMPER_TRAINER_RANK": "2"},
                 "TEMPER_TRAINER_RANK=2 is not below TEMPER_TRAINER_WORLD_SIZE=2"),
    }
    procs = {}
    for name, (model, env, _) in cases.items():
        (tmp_path / name).mkdir()
        # no other rank and an unused address: a start that got past the check would wait to join, not refuse
        procs[name] = trainer(tmp_path / name, Path(model), TEMPER_TRAINER_GROUP_ADDR=f"127.0.0.1:{free_port()}",
                              TEMPER_TRAINER_GROUP_TIMEOUT_SECONDS="60", **env)
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=45)
        finally:
            proc.kill()
        lines = err.strip().splitlines()
        assert proc.returncode == 1, (name, err)
        assert lines and lines[-1].startswith("temper trainer: rank "), (name, err)
        assert cases[name][2] in lines[-1], (name, lines[-1])
        assert "listening" not in err and "joined the trainer group" not in err, (name, err)


def test_a_rank_that_never_joins_fails_rank_0_within_the_timeout(tiny_dirs, tmp_path):
    start = time.monotonic()
    proc = trainer(tmp_path, tiny_dirs["qwen3"], TEMPER_TRAINER_WORLD_SIZE="2", TEMPER_TRAINER_RANK="0",
                   TEMPER_TRAINER_GROUP_ADDR=f"127.0.0.1:{free_port()}",
                   TEMPER_TRAINER_GROUP_TIMEOUT_SECONDS=str(TIMEOUT))
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    elapsed = time.monotonic() - start
    assert proc.returncode == GROUP_FAILED, err
    line = next(line for line in err.splitlines() if line.startswith("temper trainer: "))
    assert "rank 0/2" in line and f"did not form within {TIMEOUT:g}s" in line and "rank 0 waited for rank 1" in line, line
    assert "1/2 clients joined" in line, line
    waited = float(line.split("s waited")[0].rsplit("(", 1)[1])
    assert waited < TIMEOUT + SLACK, line
    assert "trainer group failed" in err, err
    assert elapsed < 40, elapsed  # interpreter, torch, the tiny model, then the timeout: never a hang


# ---- a partition: rank 1 frozen (SIGSTOP) -----------------------------------------------------------------


def rank_main(rank, addr, folder, tmp, mode, ready, barrier):
    """One rank of a two-rank group. Rank 0 creates an adapter, says so, then idles (``mode`` "idle":
    only the heartbeat talks to rank 1) or runs cycles back to back ("cycle")."""
    import torch
    from temper.common.validation import DecodedDatum
    from temper.services.lora.model import AdapterSpec
    from temper.services.models.loading import load_model
    from temper.services.trainer import group
    from temper.services.trainer.adapters import lora_targets
    from temper.services.trainer.engine import AdamParams, ForwardBackwardItem, OptimStepItem
    from temper.services.trainer.settings import TrainerSettings

    torch.set_num_threads(1)
    logging.basicConfig(filename=str(tmp / f"rank{rank}.log"), level=logging.INFO, force=True)
    settings = group.group_settings(TrainerSettings(
        base_model=str(folder), checkpoint_dir=tmp / "ckpt", offload_dir=tmp / "offload", num_threads=1,
        world_size=2, rank=rank, group_addr=addr, group_timeout_seconds=TIMEOUT))
    loaded = load_model(settings.base_model)
    barrier.wait(timeout=60)  # both loaded: the join's short timeout is not spent on imports
    joined = group.join(settings)
    engine = group.build_engine(loaded, settings, joined)
    if rank > 0:
        group.follow(engine, joined)
    leader = group.GroupEngine(engine, joined)
    leader.create_adapter("a", AdapterSpec(rank=2, alpha=4.0, targets=lora_targets(attn=True, mlp=True)), 1)
    rng = np.random.default_rng(0)
    items = []
    for _ in range(4):
        tokens = rng.integers(0, 512, 24)
        items.append(ForwardBackwardItem("a", [DecodedDatum(
            tokens=tokens[:-1].astype(np.int32),
            inputs={"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(23, np.float32)})]))
    leader.run_cycle(items, [OptimStepItem("a", AdamParams(learning_rate=1e-3))])
    ready.put("ready")
    while True:
        if mode == "idle":
            time.sleep(1.0)
        else:
            leader.run_cycle(items, [OptimStepItem("a", AdamParams(learning_rate=1e-3))])


@pytest.mark.parametrize("mode", ["idle", "cycle"])
def test_a_partitioned_rank_fails_the_group_within_the_timeout(tiny_dirs, tmp_path, mode):
    ctx = mp.get_context("spawn")
    ready, barrier = ctx.Queue(), ctx.Barrier(2)
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, addr, tiny_dirs["qwen3"], tmp_path, mode, ready, barrier))
             for r in range(2)]
    for p in procs:
        p.start()
    leader, follower = procs
    try:
        assert ready.get(timeout=90) == "ready"
        time.sleep(0.5 if mode == "cycle" else TIMEOUT)  # idle: a few heartbeats go round first
        assert leader.exitcode is None and follower.exitcode is None
        os.kill(follower.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        leader.join(timeout=TIMEOUT * 1.25 + SLACK + 10)
        elapsed = time.monotonic() - stopped
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
            p.join(timeout=10)
    log = (tmp_path / "rank0.log").read_text()
    assert leader.exitcode == GROUP_FAILED, log
    # the heartbeat's period (timeout / 4) before the ping at most, then the timeout
    assert elapsed < TIMEOUT * 1.25 + SLACK, (elapsed, log)
    failure = [line for line in log.splitlines() if "trainer group failed" in line]
    assert failure, log
    assert ("heartbeat" if mode == "idle" else "run_cycle") in failure[-1], failure
