"""A scheduler replica killed (SIGKILL) or frozen (SIGSTOP) under load (issue 32): the survivor takes
its lanes once the lease runs out, the clients' resends (round_robin over both replicas) get every
verb answered, nothing acknowledged is lost or applied twice (each run's weights equal a twin's
trained alone on the same requests, bit for bit: deterministic runs), and a frozen replica that
wakes after losing its leases writes nothing and stops."""

from __future__ import annotations

import signal
import threading
import time

from safetensors.numpy import load_file
from sqlalchemy import create_engine, text

from fixtures_stack import assert_same_weights
from replica_fixtures import (ADAM, LEASE_SECONDS, data_for, lane_holders, replica_addresses, run_lanes, train_alone,  # noqa: F401
                              two, wait_balanced)  # two: a fixture

STEPS = 4
RUNS = 4  # two on each trainer's lane


class Load:
    """Each run in a thread of its own: STEPS rounds of forward_backward then optim_step, each waited
    for, through one client on every replica's address. Records what was acknowledged and when."""

    def __init__(self, stack, model: str):
        self.clients = [stack.client("tina"), stack.client("uma")]  # two tenants, interleaved on both lanes
        self.runs = [self.client_of(i).create_lora_training_client(model, seed=100 + i, rank=4, deterministic=True).result()
                     for i in range(RUNS)]
        self.data = [data_for(200 + i) for i in range(RUNS)]
        self.acknowledged = [0] * RUNS
        self.answered_at: list[list[float]] = [[] for _ in range(RUNS)]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._train, args=(i,), daemon=True) for i in range(RUNS)]

    def client_of(self, i: int):
        return self.clients[i % 2]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def _train(self, i: int) -> None:
        try:
            for _ in range(STEPS):
                self.runs[i].forward_backward(self.data[i]).result()
                self.answered_at[i].append(time.monotonic())
                self.runs[i].optim_step(ADAM).result()
                self.answered_at[i].append(time.monotonic())
                self.acknowledged[i] += 1
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.errors.append(exc)

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def wait_for_steps(self, steps: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while min(self.acknowledged) < steps:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, self.acknowledged
            time.sleep(0.05)

    def join(self, url: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not self.errors, self.errors
        assert self.acknowledged == [STEPS] * RUNS, runs_state(url, [tc.model_id for tc in self.runs])


def runs_state(url: str, run_ids: list[str]) -> list[tuple]:
    """Every request row and counter of the runs: what a write after a lost lease would change."""
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT training_run_id, seq_id, status, finished_at FROM requests WHERE training_run_id = ANY(:ids)"
                                 " ORDER BY 1, 2"), {"ids": run_ids}).all()
        runs = conn.execute(text("SELECT id, next_seq_id, steps, tokens_trained, snapshot_key FROM training_runs WHERE id = ANY(:ids)"
                                 " ORDER BY 1"), {"ids": run_ids}).all()
    engine.dispose()
    return [tuple(r) for r in rows] + [tuple(r) for r in runs]


def assert_twins(stack, load: Load, model: str, tmp_path) -> None:
    """Every run's weights equal a twin's trained alone on the same requests; the steps counted once."""
    state = {r[0]: r for r in runs_state(stack.url, [tc.model_id for tc in load.runs]) if len(r) == 5}
    for i, tc in enumerate(load.runs):
        assert state[tc.model_id][2] == STEPS  # optim steps recorded once each
        client = load.client_of(i)
        got = load_file(str(client.download_checkpoint(tc.save_weights_for_sampler("end").result().path, tmp_path / f"g{i}")
                            / "adapter_model.safetensors"))
        twin = train_alone(client, model, 100 + i, 4, STEPS, load.data[i])
        want = load_file(str(client.download_checkpoint(twin, tmp_path / f"w{i}") / "adapter_model.safetensors"))
        assert_same_weights(got, want)


def test_a_replica_killed_under_load_loses_nothing_acknowledged(two, tiny_model_dir, tmp_path):
    load = Load(two, tiny_model_dir)
    lanes = run_lanes(two.url, [tc.model_id for tc in load.runs])
    assert len(set(lanes.values())) == 2  # runs on both lanes
    owners = wait_balanced(two, two.url)
    victim_lane = sorted(owners)[0]
    victim = next(s for s in two.services_of("scheduler") if s.address == owners[victim_lane])
    token_before = lane_holders(two.url)[victim_lane][1]
    load.start().wait_for_steps(2)
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=30)
    load.join(two.url)
    try:
        holders = lane_holders(two.url)
        survivor = next(s for s in two.services_of("scheduler") if s is not victim)
        assert {replica_addresses(two.url)[owner] for owner, _ in holders.values()} == {survivor.address}
        assert holders[victim_lane][1] == token_before + 1  # taken over with the next fencing token
        assert_twins(two, load, tiny_model_dir, tmp_path)
    finally:
        load.close()


def test_a_frozen_replica_loses_its_lanes_and_writes_nothing_when_it_wakes(two, tiny_model_dir, tmp_path):
    load = Load(two, tiny_model_dir)
    owners = wait_balanced(two, two.url)
    frozen_lane = sorted(owners)[0]
    frozen = next(s for s in two.services_of("scheduler") if s.address == owners[frozen_lane])
    survivor = next(s for s in two.services_of("scheduler") if s is not frozen)
    load.start().wait_for_steps(2)
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        load.join(two.url)
        holders = lane_holders(two.url)
        assert {replica_addresses(two.url)[owner] for owner, _ in holders.values()} == {survivor.address}
        run_ids = [tc.model_id for tc in load.runs]
        before = runs_state(two.url, run_ids)
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    # awake, it finds its leases taken: it stops (EXIT_LEASE_LOST, or its loop's fenced write failed)
    assert frozen.process.wait(timeout=10 * LEASE_SECONDS) in (3, 4)
    assert runs_state(two.url, run_ids) == before  # nothing written after the lease was lost
    try:
        assert_twins(two, load, tiny_model_dir, tmp_path)
    finally:
        load.close()
