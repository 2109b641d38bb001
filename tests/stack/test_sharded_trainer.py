"""A trainer group (issue 20, services/trainer/group.py) on the real stack and Postgres: a trainer of two
local processes, its base model sharded over them, is one trainer to the scheduler.

Two tenants train on it co-batched; their losses and adapters equal their twins' trained on the
session's one-process stack (same seeds) within 1e-5, and so do the logprobs the sampler computes and
samples with the weights the group published (save_weights_for_sampler: trainer -> sampler). Then rank 1 is killed (SIGKILL) mid-training:
rank 0 notices, exits with GROUP_FAILED, the group is started again, and the scheduler restores the
runs from their snapshots and replays the rest: every call succeeds, and the runs still equal twins
trained without a kill."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from fixtures_stack import adapter_weights, sft_datum
from temper.client import AdamParams, ModelInput, SamplingParams
from temper.services.trainer.group import GROUP_FAILED
from test_faults import metric

ADAM = AdamParams(learning_rate=5e-3, eps=1e-8)
TENANTS = {"alice": (31, dict(rank=4)), "bob": (32, dict(rank=8, train_mlp=False))}


def rounds(seed: int, count: int) -> list[list]:
    rng = np.random.default_rng(seed)
    return [[sft_datum(rng.integers(0, 512, int(n)).tolist()) for n in rng.integers(5, 14, 3)] for _ in range(count)]


DATA = {tenant: rounds(seed, 8) for tenant, (seed, _) in TENANTS.items()}


@pytest.fixture(scope="module")
def group_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    from temper.localstack import LocalStack

    env = {"TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS": "2", "TEMPER_TRAINER_GROUP_TIMEOUT_SECONDS": "8"}
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("group-stack"), database_url=new_postgres_database("temper_group"),
                    num_threads=1, extra_env=env, trainer_world_size=2) as local:
        local.address = local.start()
        yield local


def create_runs(stack, base_model):
    return {tenant: stack.client(tenant).create_lora_training_client(base_model, seed=seed, **lora)
            for tenant, (seed, lora) in TENANTS.items()}


def train(runs, steps):
    """``steps`` of fb + optim for every run, submitted together (co-batched); their futures."""
    pending = []
    for tenant, tc in runs.items():
        for data in DATA[tenant][steps]:
            pending.append((tenant, tc.forward_backward(data), tc.optim_step(ADAM)))
    return pending


def losses(pending):
    out = {}
    for tenant, fb, step in pending:
        out.setdefault(tenant, []).append(fb.result(timeout=300).metrics["loss:sum"])
        assert step.result(timeout=300).metrics
    return out


def weights(stack, tenant, tc, tmp_path):
    name = f"w-{uuid.uuid4().hex[:8]}"
    path = tc.save_weights_for_sampler(name).result(timeout=300).path
    with stack.client(tenant) as client:
        return adapter_weights(client, path, tmp_path / name)


PROMPT = [7, 19, 42, 101, 250, 33, 77, 5]


def sampled(stack, tenant, path) -> dict:
    """What the stack's sampler gives for the published weights at ``path``: prompt logprobs, and a
    greedy sample's tokens and logprobs."""
    with stack.client(tenant) as client:
        sampler = client.create_sampling_client(model_path=path)
        prompt = sampler.compute_logprobs(ModelInput.from_ints(PROMPT)).result(timeout=300)
        greedy = SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        [sequence] = sampler.sample(ModelInput.from_ints(PROMPT[:3]), 1, greedy).result(timeout=300).sequences
    assert prompt[0] is None and sequence.logprobs is not None
    return {"prompt": np.array(prompt[1:], dtype=np.float64), "tokens": sequence.tokens,
            "logprobs": np.array(sequence.logprobs, dtype=np.float64)}


def assert_close(got, want):
    assert got.keys() == want.keys()
    for key in got:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)


def test_a_two_rank_trainer_trains_like_one_process(group_stack, stack, tiny_model_dir, tmp_path):
    info = group_stack.group_ranks("trainer")
    assert len(info) == 2 and all(s.process.poll() is None for s in info)
    sharded = create_runs(group_stack, tiny_model_dir)
    twins = create_runs(stack, tiny_model_dir)
    got = losses(train(sharded, slice(0, 3)))
    want = losses(train(twins, slice(0, 3)))
    for tenant in TENANTS:
        np.testing.assert_allclose(got[tenant], want[tenant], rtol=1e-5, err_msg=tenant)
        assert_close(weights(group_stack, tenant, sharded[tenant], tmp_path), weights(stack, tenant, twins[tenant], tmp_path))
    # the publish path from a sharded trainer: its sampler samples as the one-process twin's does
    for tenant in TENANTS:
        name = f"s-{uuid.uuid4().hex[:8]}"
        mine = sampled(group_stack, tenant, sharded[tenant].save_weights_for_sampler(name).result(timeout=300).path)
        twin = sampled(stack, tenant, twins[tenant].save_weights_for_sampler(name).result(timeout=300).path)
        np.testing.assert_allclose(mine["prompt"], twin["prompt"], atol=1e-5, rtol=0, err_msg=tenant)
        assert mine["tokens"] == twin["tokens"], tenant
        np.testing.assert_allclose(mine["logprobs"], twin["logprobs"], atol=1e-5, rtol=0, err_msg=tenant)


def test_a_killed_rank_fails_the_group_and_a_restarted_group_loses_nothing(group_stack, stack, tiny_model_dir, tmp_path):
    runs = create_runs(group_stack, tiny_model_dir)
    losses(train(runs, slice(0, 3)))  # steps 1-3; snapshots every 2 steps
    leader, follower = group_stack.group_ranks("trainer")
    group_stack.pause(follower.name)  # so that rank 0 is surely inside a cycle's collectives when rank 1 dies
    pending = train(runs, slice(3, 8))
    time.sleep(1.0)
    follower.process.kill()  # SIGKILL rank 1 mid-training
    assert leader.process.wait(timeout=60) == GROUP_FAILED  # rank 0 notices and exits, saying why
    failure = [line for line in leader.log_path.read_text().splitlines() if "trainer group failed" in line]
    assert failure and "run_cycle" in failure[-1], failure
    group_stack.restart_group("trainer")
    got = losses(pending)  # every call succeeds, some late (restored + replayed)
    twins = create_runs(stack, tiny_model_dir)
    want = losses(train(twins, slice(0, 8)))
    assert metric(group_stack.service("scheduler"), 'temper_scheduler_runs_restored_total{outcome="restored"}') >= 2
    for tenant in TENANTS:
        np.testing.assert_allclose(got[tenant], want[tenant][3:], rtol=1e-5, err_msg=tenant)
        assert_close(weights(group_stack, tenant, runs[tenant], tmp_path), weights(stack, tenant, twins[tenant], tmp_path))
