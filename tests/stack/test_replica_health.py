"""A scheduler replica's Health (issue 32): SERVING while its database and leases answer, NOT_SERVING
while its database is unreachable (round_robin clients and load balancers then leave it), SERVING
again once it renews its leases; and its lanes' work goes on afterwards."""

from __future__ import annotations

import queue
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replica_fixtures import ADAM, LEASE_SECONDS, data_for
from test_faults import FlakyProxy, start_stack, tcp_upstream

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def watch(address: str) -> "queue.Queue[int]":
    """Health Watch of the whole server, its statuses as they come."""
    statuses: queue.Queue[int] = queue.Queue()

    def pump():
        channel = grpc.insecure_channel(address)
        try:
            for answer in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
                statuses.put(answer.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=pump, daemon=True).start()
    return statuses


def next_status(statuses: "queue.Queue[int]", wanted: int, timeout: float) -> None:
    seen = []
    while True:
        status = statuses.get(timeout=timeout)
        seen.append(status)
        if status == wanted:
            return


def test_a_replica_without_its_database_is_not_serving_until_it_renews(tiny_model_dir, new_postgres_database, tmp_path):
    real_url = new_postgres_database("temper_replica_health")
    with FlakyProxy(tcp_upstream(real_url)) as proxy, \
            start_stack(tiny_model_dir, proxy.url(real_url), tmp_path / "stack", TEMPER_SCHEDULER_REPLICAS="true",
                        TEMPER_SCHEDULER_LEASE_SECONDS=str(LEASE_SECONDS)) as local:
        client = local.client("hana")
        try:
            tc = client.create_lora_training_client(tiny_model_dir, seed=1, rank=4)
            tc.forward_backward(data_for(1)).result()
            statuses = watch(local.address)
            next_status(statuses, SERVING, timeout=30)
            proxy.down()  # longer than the lease: it expires, and nobody else takes the lane
            next_status(statuses, NOT_SERVING, timeout=10 * LEASE_SECONDS)
            proxy.up()
            next_status(statuses, SERVING, timeout=30)
            tc.optim_step(ADAM).result()  # its lease renewed (no newer token exists), the lane runs on
            tc.forward_backward(data_for(2)).result()
        finally:
            client.close()
