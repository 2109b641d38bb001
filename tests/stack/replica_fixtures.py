"""Helpers for stacks of several scheduler replicas (issue 32): who holds which lane, waiting for the
lanes to settle, and a twin stack of one scheduler to compare weights with."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import sft_datum
from temper.client import AdamParams
from temper.localstack import LocalStack

ADAM = AdamParams(learning_rate=5e-3, eps=1e-8)
LEASE_SECONDS = 3.0  # the default: shorter leases ran out on a busy 2-core machine (CI runs stacks side by side)


def replicated_stack(model: str, folder, url: str, replicas: int, trainers: int, **env) -> LocalStack:
    local = LocalStack(model, folder, database_url=url, num_threads=1, num_trainers=trainers, num_schedulers=replicas,
                       extra_env={"TEMPER_SCHEDULER_LEASE_SECONDS": str(LEASE_SECONDS), **env})
    local.address = local.start()
    return local


@pytest.fixture
def two(tiny_model_dir, new_postgres_database, tmp_path):
    """Two replicas and two trainers on a fresh database, the lanes settled one each (import it into the test module)."""
    url = new_postgres_database()
    with replicated_stack(tiny_model_dir, tmp_path / "two", url, replicas=2, trainers=2) as local:
        local.url = url
        wait_balanced(local, url)
        yield local


def run_lanes(url: str, run_ids: list[str]) -> dict[str, str]:
    """Run id -> the trainer (lane) it is placed on."""
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, trainer FROM training_runs WHERE id = ANY(:ids)"), {"ids": run_ids}).all()
    engine.dispose()
    return dict(rows)


def lane_holders(url: str) -> dict[str, tuple[str, int]]:
    """lane -> (owner, token) of every live lease."""
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT lane, owner, token FROM lane_leases WHERE expires_at > clock_timestamp() AND owner <> ''")).all()
    engine.dispose()
    return {r.lane: (r.owner, r.token) for r in rows}


def replica_addresses(url: str) -> dict[str, str]:
    """owner -> address of every live replica."""
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT owner, address FROM scheduler_replicas WHERE NOT stopped")).all()
    engine.dispose()
    return {r.owner: r.address for r in rows}


def wait_balanced(stack: LocalStack, url: str, timeout: float = 60.0) -> dict[str, str]:
    """Until every trainer's lane is held and no live replica holds more than its fair share;
    returns lane -> the address of the replica holding it."""
    lanes = {s.address for s in stack.services_of("trainer")}
    replicas = {s.address for s in stack.services_of("scheduler") if s.process.poll() is None}
    fair = -(-len(lanes) // len(replicas))
    deadline = time.monotonic() + timeout
    while True:
        holders, addresses = lane_holders(url), replica_addresses(url)
        owners = [addresses.get(owner) for owner, _ in holders.values()]
        if set(holders) == lanes and set(owners) <= replicas and all(owners.count(r) <= fair for r in replicas):
            return {lane: addresses[owner] for lane, (owner, _) in holders.items()}
        assert time.monotonic() < deadline, (holders, addresses, lanes, replicas)
        time.sleep(0.1)


def counter(stack: LocalStack, name: str, metric: str) -> float:
    """The sum of a Prometheus counter's series on service ``name``."""
    with urllib.request.urlopen(stack.service(name).metrics_url, timeout=10) as page:
        lines = page.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(metric + "{") or line.startswith(metric + " "))


def data_for(seed: int):
    rng = np.random.default_rng(seed)
    return [sft_datum(rng.integers(0, 512, int(n)).tolist()) for n in rng.integers(6, 16, 2)]


def train_alone(client, model: str, seed: int, rank: int, steps: int, data) -> str:
    """A twin: the run trained alone (deterministic), one request at a time; its sampler weights' path."""
    tc = client.create_lora_training_client(model, seed=seed, rank=rank, deterministic=True)
    for _ in range(steps):
        tc.forward_backward(data).result()
        tc.optim_step(ADAM).result()
    return tc.save_weights_for_sampler("twin").result().path
