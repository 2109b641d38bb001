"""Several scheduler replicas on one PostgreSQL database (issue 32, docs/replicas.md), as real
processes: the lanes split between them, any replica takes any verb (a lane's verbs are forwarded
to its owner), interleaved tenants train to the weights one scheduler gives them, and sampling is
answered by whichever replica gets it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file
from sqlalchemy import create_engine, text

from fixtures_stack import assert_same_weights, keyed_channel, sft_datum
from replica_fixtures import ADAM, counter, data_for, lane_holders, replicated_stack, train_alone, wait_balanced
from temper.client import ModelInput, SamplingParams, ServiceClient, convert
from temper.localstack import LocalStack
from temper.v1 import service_pb2, service_pb2_grpc

STEPS = 3


@pytest.fixture(scope="module")
def three(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database()
    with replicated_stack(tiny_model_dir, tmp_path_factory.mktemp("three"), url, replicas=3, trainers=3) as local:
        local.url = url
        wait_balanced(local, url)
        yield local


@pytest.fixture(scope="module")
def single(tiny_model_dir, new_postgres_database, tmp_path_factory):
    """One scheduler, one trainer: where the twins train."""
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("single"), database_url=new_postgres_database(), num_threads=1) as local:
        local.address = local.start()
        yield local


def weights(client, path, folder):
    return load_file(str(client.download_checkpoint(path, folder) / "adapter_model.safetensors"))


def replica_stub(stack, address: str, tenant: str = "local") -> service_pb2_grpc.TemperStub:
    """A raw stub on one replica (not the round_robin list)."""
    class One:
        pass
    one = One()
    one.address, one.key_for = address, stack.key_for
    return service_pb2_grpc.TemperStub(keyed_channel(one, tenant))


def test_three_replicas_split_the_lanes_and_train_interleaved_tenants_like_one_scheduler(three, single, tiny_model_dir, tmp_path):
    owners = wait_balanced(three, three.url)
    assert len(set(owners.values())) == 3  # 3 lanes, 3 replicas: one each
    clients = {tenant: three.client(tenant) for tenant in ("alice", "bob")}
    twins = {tenant: single.client(tenant) for tenant in ("alice", "bob")}
    try:
        # deterministic runs (docs/deterministic.md): co-batched equals alone bit for bit, so the twins are exact
        runs = {(tenant, i): c.create_lora_training_client(tiny_model_dir, seed=10 * i + len(tenant), rank=4, deterministic=True)
                for tenant, c in clients.items() for i in range(3)}
        data = {key: data_for(hash(key) % 1000) for key in runs}
        pending = []
        for _ in range(STEPS):  # everything submitted before waiting: tenants interleave on every replica
            for key, tc in runs.items():
                pending += [tc.forward_backward(data[key]), tc.optim_step(ADAM)]
        [f.result() for f in pending]
        forwarded = sum(counter(three, s.name, "temper_scheduler_forwarded_total") for s in three.services_of("scheduler"))
        assert forwarded > 0  # round_robin sent some verbs to replicas that do not own their run's lane
        for (tenant, i), tc in runs.items():
            got = weights(clients[tenant], tc.save_weights_for_sampler("w").result().path, tmp_path / f"r{tenant}{i}")
            twin_path = train_alone(twins[tenant], tiny_model_dir, 10 * i + len(tenant), 4, STEPS, data[(tenant, i)])
            want = weights(twins[tenant], twin_path, tmp_path / f"t{tenant}{i}")
            assert_same_weights(got, want)
            assert any(np.abs(v).max() > 0 for k, v in got.items() if "lora_B" in k)
        usage = clients["alice"].get_usage()
        assert {runs[("alice", i)].model_id for i in range(3)} <= set(usage["runs"])
        assert all(usage["runs"][runs[("alice", i)].model_id]["steps"] == STEPS for i in range(3))
    finally:
        for c in [*clients.values(), *twins.values()]:
            c.close()


def test_new_runs_are_placed_across_every_lane(three, tiny_model_dir):
    client = three.client("carol")
    try:
        # one after the other: concurrent creations through different replicas count each other's runs only
        # once their rows exist (docs/replicas.md, placement)
        runs = [client.create_lora_training_client(tiny_model_dir, seed=i, rank=4).result() for i in range(6)]
        engine = create_engine(three.url)
        with engine.connect() as conn:
            placed = conn.execute(text("SELECT trainer, count(*) FROM training_runs WHERE id = ANY(:ids) GROUP BY trainer"),
                                  {"ids": [tc.model_id for tc in runs]}).all()
        engine.dispose()
        assert sorted(n for _, n in placed) == [2, 2, 2]  # counted in the database, whichever replica placed them
    finally:
        client.close()


def test_a_verb_sent_to_any_replica_is_answered_by_the_lane_owner(three, tiny_model_dir):
    client = three.client("dave")
    try:
        tc = client.create_lora_training_client(tiny_model_dir, seed=3, rank=4)
        owners = wait_balanced(three, three.url)
        replicas = [s.address for s in three.services_of("scheduler")]
        owner = owners[_trainer_of(three.url, tc.model_id)]
        datum = convert.datum_to_proto(sft_datum([5, 9, 13, 17, 21]))
        for seq, address in enumerate([a for a in replicas if a != owner] + [owner], start=1):
            stub = replica_stub(three, address, "dave")
            answer = stub.ForwardBackward(service_pb2.ForwardBackwardRequest(
                training_run_id=tc.model_id, seq_id=seq, data=[datum], loss_fn="cross_entropy"))
            assert answer.loss_fn_outputs  # answered through whichever replica got it
        infos = [replica_stub(three, a, "dave").GetInfo(service_pb2.GetInfoRequest(training_run_id=tc.model_id))
                 for a in replicas]
        assert {info.next_seq_id for info in infos} == {len(replicas) + 1}  # the owner's queue, from every replica
        # a resend of an answered seq, through a non-owner: the first answer, not a second application
        again = replica_stub(three, replicas[0] if replicas[0] != owner else replicas[1], "dave").ForwardBackward(
            service_pb2.ForwardBackwardRequest(training_run_id=tc.model_id, seq_id=1, data=[datum], loss_fn="cross_entropy"))
        assert again.loss_fn_outputs
        # another tenant's run is NOT_FOUND at the first replica, before any hop
        with pytest.raises(grpc.RpcError) as refused:
            replica_stub(three, [a for a in replicas if a != owner][0], "erin").GetInfo(
                service_pb2.GetInfoRequest(training_run_id=tc.model_id))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        # a forwarded call never hops twice: one that lands on a non-owner answers UNAVAILABLE
        stub = replica_stub(three, [a for a in replicas if a != owner][0], "dave")
        with pytest.raises(grpc.RpcError) as twice:
            stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=tc.model_id),
                         metadata=[("temper-forwarded-from", "some-replica")])
        assert twice.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()


def test_sampling_is_answered_by_every_replica(three, tiny_model_dir):
    client = three.client("frank")
    try:
        tc = client.create_lora_training_client(tiny_model_dir, seed=4, rank=4)
        tc.forward_backward(data_for(4)).result()
        tc.optim_step(ADAM).result()
        path = tc.save_weights_for_sampler("s").result().path
        for address in [s.address for s in three.services_of("scheduler")]:
            one = ServiceClient(address, api_key=three.key_for("frank"))
            try:
                sampler = one.create_sampling_client(model_path=path)
                answer = sampler.sample(ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=4, stop=[])).result()
                assert len(answer.sequences[0].tokens) == 4
            finally:
                one.close()
    finally:
        client.close()


def _trainer_of(url: str, run_id: str) -> str:
    engine = create_engine(url)
    with engine.connect() as conn:
        trainer = conn.execute(text("SELECT trainer FROM training_runs WHERE id = :r"), {"r": run_id}).scalar_one()
    engine.dispose()
    return trainer


def test_each_trainer_refuses_a_lane_token_older_than_its_owners(three):
    """The owners claimed their trainers when they took the lanes (common/lane_fence.py): a call with an
    older token — a former owner waking up — is refused before it runs; the owner's own token passes."""
    from temper.common.auth import bearer_metadata
    from temper.v1 import trainer_pb2, trainer_pb2_grpc

    for lane, (_, token) in lane_holders(three.url).items():
        with grpc.insecure_channel(lane) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            auth = bearer_metadata(three.internal_token)
            stub.GetModelInfo(trainer_pb2.GetModelInfoRequest(), metadata=[auth, ("temper-lane-token", str(token))])
            with pytest.raises(grpc.RpcError) as stale:
                stub.GetModelInfo(trainer_pb2.GetModelInfoRequest(), metadata=[auth, ("temper-lane-token", str(token - 1))])
            assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "older" in stale.value.details()


def test_the_admin_command_lists_the_replicas_and_their_leases(three, capsys):
    from temper.scheduler.admin import main

    owners = wait_balanced(three, three.url)
    assert main(["--database-url", three.url, "replicas"]) == 0
    printed = capsys.readouterr().out
    replicas, lanes = printed.split("\n\n")
    assert sum(" live " in line for line in replicas.splitlines()[1:]) == 3
    for lane, address in owners.items():  # each lane once, held by its owner's address
        assert [line.split()[1] for line in lanes.splitlines()[1:] if line.startswith(lane)] == [address]


def test_a_replica_stopped_cleanly_hands_its_lanes_over_at_once(three):
    """SIGTERM: the replica releases its leases as it stops; the others take the lanes in their next
    round, each with the next token (this test runs last: the stack keeps two replicas)."""
    before = lane_holders(three.url)
    leaving = three.services_of("scheduler")[-1]
    leaving.process.terminate()
    assert leaving.process.wait(timeout=30) == 0
    engine = create_engine(three.url)
    with engine.connect() as conn:
        stopped = conn.execute(text("SELECT stopped FROM scheduler_replicas WHERE address = :a ORDER BY started_at DESC"),
                               {"a": leaving.address}).scalars().first()
    engine.dispose()
    assert stopped  # marked stopped: the others count it out of the fair share at once
    three.services.remove(leaving)
    after = wait_balanced(three, three.url)
    assert leaving.address not in after.values()
    held = lane_holders(three.url)
    for lane, (owner, token) in before.items():
        assert held[lane][1] >= token
