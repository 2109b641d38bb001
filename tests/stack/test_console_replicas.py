"""The operator's view of scheduler replicas (issue 32) on a real stack: two replicas and two trainers
on one PostgreSQL database, with the gateway in front. GetClusterStatus, asked of either replica,
lists both replicas (live, their addresses, which one answered) and every lane exactly once under
the live replica whose lease holds it; the console's admin JSON route (/console/api/cluster) says
the same, and refuses a tenant's key."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from temper.localstack import LocalStack
from temper.scheduler.admin import create_key
from temper.services.gateway.console.views import view
from temper.v1 import service_pb2, service_pb2_grpc

LEASE_SECONDS = 3.0  # TEMPER_SCHEDULER_LEASE_SECONDS's default: a round every second
CONVERGE_SECONDS = 60.0  # a limit only: the later replica gets its lane within a few rounds


@pytest.fixture(scope="module")
def replicated(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_console_replicas")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("console_replicas"), database_url=url, num_threads=1,
                    num_trainers=2, num_schedulers=2, gateway=True) as stack:
        stack.start()
        yield {"stack": stack, "ops": create_key(url, "ops", label="replicas test", is_admin=True),
               "schedulers": [s.address for s in stack.services_of("scheduler")],
               "trainers": sorted(s.address for s in stack.services_of("trainer"))}


def cluster_status(address: str, key: str) -> service_pb2.ClusterStatus:
    with grpc.insecure_channel(address) as channel:
        return service_pb2_grpc.TemperStub(channel).GetClusterStatus(
            service_pb2.GetClusterStatusRequest(), metadata=[("authorization", f"Bearer {key}")], timeout=30)


def holders(status) -> dict[str, list[str]]:
    """lane -> the owners whose lease names it ('' for a free lane), from one answer."""
    found: dict[str, list[str]] = {}
    for replica in status["replicas"]:
        for lane in replica["lanes"]:
            found.setdefault(lane["trainer_address"], []).append(replica["owner"])
    for lane in status["free_lanes"]:
        found.setdefault(lane["trainer_address"], []).append("")
    return found


def settled(status: dict, trainers: list[str]) -> bool:
    """Each live replica holds its fair share (one lane each), every lane's lease live."""
    live = [r for r in status["replicas"] if r["live"]]
    return len(live) == 2 and all(len([x for x in r["lanes"] if x["live"]]) == 1 for r in live) \
        and sorted(holders(status)) == trainers


@pytest.fixture(scope="module")
def answers(replicated):
    """GetClusterStatus asked of each replica once the lanes have settled (one per replica)."""
    first = replicated["schedulers"][0]
    deadline = time.monotonic() + CONVERGE_SECONDS
    status = view(cluster_status(first, replicated["ops"]))
    while not settled(status, replicated["trainers"]):
        assert time.monotonic() < deadline, f"the two replicas never settled on one lane each: {status['replicas']}"
        time.sleep(0.2)
        status = view(cluster_status(first, replicated["ops"]))
    return {address: view(cluster_status(address, replicated["ops"])) for address in replicated["schedulers"]}


def check_replicas(status: dict, replicated: dict) -> None:
    assert status["replicated"] is True
    replicas = status["replicas"]
    assert sorted(r["address"] for r in replicas) == sorted(replicated["schedulers"])
    assert len({r["owner"] for r in replicas}) == 2 and all(r["owner"] for r in replicas)
    assert all(r["live"] and r["seconds_since_heard"] >= 0 for r in replicas)
    now_ms = time.time() * 1000
    assert all(0 < r["started_at_unix_ms"] <= now_ms for r in replicas)
    lanes = holders(status)
    assert sorted(lanes) == replicated["trainers"]
    assert all(len(owners) == 1 and owners[0] for owners in lanes.values()), f"each lane once, held: {lanes}"
    assert status["free_lanes"] == []
    for replica in replicas:
        for lane in replica["lanes"]:
            assert lane["live"] and lane["token"] >= 1, lane
            assert lane["lease_age_seconds"] >= 0, lane
            # renewed_at + ttl = expires_at: age and time left add up to the lease's 3 s (the database's clock)
            assert lane["lease_age_seconds"] + lane["seconds_left"] == pytest.approx(LEASE_SECONDS, abs=0.01), lane
    assert sorted(len(r["lanes"]) for r in replicas) == [1, 1]


def test_each_replica_reports_both_replicas_and_every_lane_once(replicated, answers):
    for address, status in answers.items():
        check_replicas(status, replicated)
        answering = [r["address"] for r in status["replicas"] if r["answering"]]
        assert answering == [address], "the replica asked says it answered, and only it"
    a, b = answers.values()
    assert holders(a) == holders(b), "one database: one answer on who holds what"
    assert {r["owner"] for r in a["replicas"]} == {r["owner"] for r in b["replicas"]}


def test_the_console_route_shows_the_same_replicas(replicated, answers):
    url = replicated["stack"].gateway_url + "/console/api/cluster"
    got = httpx.get(url, headers={"X-API-Key": replicated["ops"]}, timeout=30)
    assert got.status_code == 200
    status = got.json()
    check_replicas(status, replicated)
    assert len([r for r in status["replicas"] if r["answering"]]) == 1
    assert holders(status) == holders(next(iter(answers.values())))
    assert sorted(lane["trainer_address"] for lane in status["lanes"]) == replicated["trainers"]
    tenant = httpx.get(url, headers={"X-API-Key": replicated["stack"].key_for("alice")}, timeout=30)
    assert tenant.status_code == 403
