"""temper.localstack, the harness every stack test, recipe and the demo start services with: ready
lines give both ports, every process serves /metrics, and pause / resume / restart act on one process."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from temper.localstack import LocalStack, parse_ready_line

SERVING = health_pb2.HealthCheckResponse.SERVING


def test_parse_ready_line():
    assert parse_ready_line("TEMPER_READY trainer port=5 metrics_port=7\n") == {"role": "trainer", "port": "5", "metrics_port": "7"}
    assert parse_ready_line("TEMPER_READY scheduler port=5") == {"role": "scheduler", "port": "5"}


def check(address: str, timeout: float = 5.0) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def wait_serving(address: str, timeout: float = 60.0) -> None:
    """Follow Health/Watch until SERVING (a scheduler is ready, NOT_SERVING, before its workers answer).
    Watch is a coroutine handler behind the error interceptor: it must stream, not fail INTERNAL."""
    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=timeout)
        assert any(reply.status == SERVING for reply in watch)
        watch.cancel()


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("localstack"), num_threads=1) as stack:
        stack.start()
        yield stack


def test_every_service_reports_its_ports_and_serves_metrics(local):
    assert {s.role for s in local.services} == {"scheduler", "trainer", "sampler"}
    for service in local.services:
        assert service.port > 0 and service.metrics_port and service.metrics_port != service.port
        with urllib.request.urlopen(service.metrics_url, timeout=10) as reply:
            assert reply.status == 200 and b"# TYPE" in reply.read()
        wait_serving(service.address)


def test_pause_and_resume(local):
    local.pause("sampler")
    try:
        with pytest.raises(grpc.RpcError) as info:
            check(local.service("sampler").address, timeout=1.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        local.resume("sampler")
    assert check(local.service("sampler").address) == SERVING


def test_restart_keeps_the_port(local):
    old = local.service("trainer")
    new = local.restart("trainer")
    assert new.port == old.port and new.process.pid != old.process.pid and old.process.poll() is not None
    wait_serving(new.address)
    address = local.service("scheduler").address
    assert local.restart_scheduler(crash=False) == address
    wait_serving(address)
