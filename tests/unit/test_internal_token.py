"""The credential between the scheduler and its workers (common/internal_auth.py): a worker without
a token refuses to start unless internal_auth is disabled; the token authenticator behind
build_server refuses calls without the token; the scheduler's channels (scheduler/workers/backends.py) send
it on unary and streaming calls alike."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fakes_workers import MODEL, PAYLOAD, modeless_workers
from temper.common.auth import bearer_metadata
from temper.common.internal_auth import InternalAuthConfigError, resolve_token, token_authenticator, worker_authenticator
from temper.scheduler.workers.backends import Backends
from temper.scheduler.settings import SchedulerSettings
from temper.services.sampler.settings import SamplerSettings
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, trainer_pb2_grpc

TOKEN = "s3cret-internal-token"


@pytest.fixture(autouse=True)
def _no_ambient_tokens(monkeypatch):
    for name in list(os.environ):
        if "INTERNAL_" in name and name.startswith("TEMPER_"):
            monkeypatch.delenv(name)


def test_a_worker_without_a_token_refuses_unless_disabled(tmp_path):
    with pytest.raises(InternalAuthConfigError) as info:
        worker_authenticator(TrainerSettings(), "TEMPER_TRAINER_")
    message = str(info.value)
    assert "TEMPER_TRAINER_INTERNAL_TOKEN" in message and "TEMPER_TRAINER_INTERNAL_AUTH=disabled" in message
    assert worker_authenticator(SamplerSettings(internal_auth="disabled"), "TEMPER_SAMPLER_") is None
    assert worker_authenticator(SamplerSettings(internal_token=TOKEN), "TEMPER_SAMPLER_") is not None
    with pytest.raises(ValueError, match="internal_auth"):
        SamplerSettings(internal_auth="off")


def test_the_token_comes_from_the_setting_or_a_file(tmp_path):
    secret = tmp_path / "token"
    secret.write_text(f"{TOKEN}\n")
    assert resolve_token(TrainerSettings(internal_token_file=secret), "TEMPER_TRAINER_") == TOKEN
    assert resolve_token(SchedulerSettings(internal_token=f" {TOKEN} "), "TEMPER_SCHEDULER_") == TOKEN
    assert resolve_token(SchedulerSettings(), "TEMPER_SCHEDULER_") is None
    with pytest.raises(InternalAuthConfigError, match="not both"):
        resolve_token(TrainerSettings(internal_token=TOKEN, internal_token_file=secret), "TEMPER_TRAINER_")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InternalAuthConfigError, match="empty"):
        resolve_token(TrainerSettings(internal_token_file=tmp_path / "empty"), "TEMPER_TRAINER_")
    with pytest.raises(InternalAuthConfigError, match="cannot read"):
        resolve_token(TrainerSettings(internal_token_file=tmp_path / "missing"), "TEMPER_TRAINER_")


def test_the_trainer_process_exits_at_once_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_TRAINER_")}
    proc = subprocess.run([sys.executable, "-m", "temper.services.trainer"], env={**env, "TEMPER_TRAINER_BIND": "127.0.0.1:0"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "temper trainer: no internal token: set TEMPER_TRAINER_INTERNAL_TOKEN" in proc.stderr
    assert "TEMPER_READY" not in proc.stdout


async def _status(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _read_all(stream) -> list:
    return [item async for item in stream]


def test_workers_answer_only_calls_that_carry_the_token():
    async def body():
        async with modeless_workers(token_authenticator(TOKEN)) as workers:
            async with grpc.aio.insecure_channel(workers.trainer_address) as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                request = trainer_pb2.GetModelInfoRequest()
                assert await _status(stub.GetModelInfo(request)) == grpc.StatusCode.UNAUTHENTICATED
                wrong = [bearer_metadata("not-the-token")]
                assert await _status(stub.GetModelInfo(request, metadata=wrong)) == grpc.StatusCode.UNAUTHENTICATED
                assert await _status(stub.GetModelInfo(request, metadata=[("authorization", TOKEN)])) == grpc.StatusCode.UNAUTHENTICATED
                reading = _read_all(stub.ReadCheckpoint(trainer_pb2.ReadCheckpointRequest(checkpoint_key="k")))
                assert await _status(reading) == grpc.StatusCode.UNAUTHENTICATED
                info = await stub.GetModelInfo(request, metadata=[bearer_metadata(TOKEN)])
                assert info.base_model == MODEL
                health = health_pb2_grpc.HealthStub(channel)  # probes need no token
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(asyncio.wait_for(body(), timeout=30))


def test_the_scheduler_sends_the_token_on_every_kind_of_call():
    async def body():
        async with modeless_workers(token_authenticator(TOKEN)) as workers:
            settings = SchedulerSettings(database_url="sqlite://", trainer_addresses=[workers.trainer_address],
                                         sampler_addresses=[workers.sampler_address], internal_token=TOKEN)
            backends = Backends(settings)
            try:
                await backends.connect()                                  # unary
                trainer, sampler = backends.trainer_for(MODEL, "run"), backends.sampler_for(MODEL)
                chunks = [c async for c in trainer.read_checkpoint("k")]  # server streaming
                assert [c.data for c in chunks] == [PAYLOAD]
                await backends.push_checkpoint(trainer, sampler, "k")     # client streaming
                assert workers.sampler.pushed == {"k": PAYLOAD}
            finally:
                await backends.close()

    asyncio.run(asyncio.wait_for(body(), timeout=30))


def test_a_scheduler_with_the_wrong_token_keeps_waiting_and_says_why(caplog):
    async def body():
        async with modeless_workers(token_authenticator(TOKEN)) as workers:
            settings = SchedulerSettings(database_url="sqlite://", trainer_addresses=[workers.trainer_address],
                                         sampler_addresses=[], internal_token="wrong")
            backends = Backends(settings)
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(backends.connect(), timeout=2.0)
                assert not backends.ready
            finally:
                await backends.close()

    asyncio.run(asyncio.wait_for(body(), timeout=30))
    assert any("refused the scheduler" in r.getMessage() and "INTERNAL_TOKEN" in r.getMessage() for r in caplog.records)
