"""TLS (common/tls.py): a build_server port with a certificate answers TLS clients only; with a
client CA, only clients with a certificate it signed (mutual TLS); the scheduler's channels to its
workers, the client's ``grpcs://`` base URL and the health probe use the same files. The test PKI
(a CA, a server certificate for localhost / 127.0.0.1, a client certificate, and a stranger CA) is
made with the openssl command line."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from fakes_workers import MODEL, PAYLOAD, modeless_workers
from temper.client.runtime import Runtime, resolve_target
from temper.common import healthcheck
from temper.common.internal_auth import token_authenticator
from temper.common.tls import channel_credentials, server_credentials
from temper.scheduler.workers.backends import Backends
from temper.scheduler.settings import SchedulerSettings
from temper.services.trainer.settings import TrainerSettings

SERVING = health_pb2.HealthCheckResponse.SERVING
TOKEN = "tls-test-token"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(folder: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=folder)


def _signed(folder: Path, name: str, ca: str, extensions: str) -> None:
    (folder / f"{name}.ext").write_text(extensions)
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    assert shutil.which("openssl"), "these tests make their certificates with the openssl command"
    folder = tmp_path_factory.mktemp("pki")
    _ca(folder, "ca")
    _ca(folder, "stranger")
    _signed(folder, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _signed(folder, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _signed(folder, "stranger-client", "stranger", "extendedKeyUsage=clientAuth\n")
    return folder


async def _health(channel: grpc.aio.Channel) -> int | grpc.StatusCode:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return reply.status


def run(body) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=60))


def test_tls_files_come_in_pairs(pki):
    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file"):
        TrainerSettings(tls_cert_file=pki / "server.pem")
    with pytest.raises(ValidationError, match="tls_client_ca_file needs"):
        TrainerSettings(tls_client_ca_file=pki / "ca.pem")
    with pytest.raises(ValidationError, match="needs internal_tls_ca_file"):
        SchedulerSettings(internal_tls_cert_file=pki / "client.pem", internal_tls_key_file=pki / "client.key")
    with pytest.raises(ValueError, match="cannot read the TLS certificate"):
        server_credentials(pki / "missing.pem", pki / "server.key")


def test_a_tls_port_answers_tls_clients_only(pki):
    async def body():
        async with modeless_workers(credentials=server_credentials(pki / "server.pem", pki / "server.key")) as workers:
            address = workers.trainer_address
            async with grpc.aio.secure_channel(address, channel_credentials(pki / "ca.pem")) as channel:
                assert await _health(channel) == SERVING
            async with grpc.aio.insecure_channel(address) as channel:
                assert await _health(channel) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.secure_channel(address, channel_credentials(pki / "stranger.pem")) as channel:
                assert await _health(channel) == grpc.StatusCode.UNAVAILABLE  # a server the client cannot verify

    run(body)


def test_with_a_client_ca_only_clients_it_signed_get_in(pki):
    credentials = server_credentials(pki / "server.pem", pki / "server.key", pki / "ca.pem")

    async def body():
        async with modeless_workers(credentials=credentials) as workers:
            address = workers.trainer_address
            mutual = channel_credentials(pki / "ca.pem", pki / "client.pem", pki / "client.key")
            async with grpc.aio.secure_channel(address, mutual) as channel:
                assert await _health(channel) == SERVING
            async with grpc.aio.secure_channel(address, channel_credentials(pki / "ca.pem")) as channel:
                assert await _health(channel) == grpc.StatusCode.UNAVAILABLE  # no client certificate
            stranger = channel_credentials(pki / "ca.pem", pki / "stranger-client.pem", pki / "stranger-client.key")
            async with grpc.aio.secure_channel(address, stranger) as channel:
                assert await _health(channel) == grpc.StatusCode.UNAVAILABLE

    run(body)


def test_the_scheduler_reaches_its_workers_over_mutual_tls_with_the_token(pki):
    credentials = server_credentials(pki / "server.pem", pki / "server.key", pki / "ca.pem")

    async def body():
        async with modeless_workers(token_authenticator(TOKEN), credentials) as workers:
            settings = SchedulerSettings(
                database_url="sqlite://", trainer_addresses=[workers.trainer_address], sampler_addresses=[workers.sampler_address],
                internal_token=TOKEN, internal_tls_ca_file=pki / "ca.pem", internal_tls_cert_file=pki / "client.pem",
                internal_tls_key_file=pki / "client.key")
            backends = Backends(settings)
            try:
                await asyncio.wait_for(backends.connect(), timeout=20)
                trainer, sampler = backends.trainer_for(MODEL, "run"), backends.sampler_for(MODEL)
                assert [c.data async for c in trainer.read_checkpoint("k")] == [PAYLOAD]
                await backends.push_checkpoint(trainer, sampler, "k")
                assert workers.sampler.pushed == {"k": PAYLOAD}
            finally:
                await backends.close()

    run(body)


def test_the_client_speaks_tls_to_a_grpcs_url(pki, monkeypatch):
    monkeypatch.delenv("TEMPER_TLS_CA_FILE", raising=False)
    assert resolve_target("127.0.0.1:1") == ("127.0.0.1:1", None)
    assert resolve_target("grpc://127.0.0.1:1") == ("127.0.0.1:1", None)
    with pytest.raises(ValueError, match="scheme"):
        resolve_target("https://127.0.0.1:1")
    ca = (pki / "ca.pem").read_bytes()

    def health_through_runtime(base_url: str, root_certificates: bytes | None = None):
        target, credentials = resolve_target(base_url, root_certificates)
        runtime = Runtime(target, [], credentials=credentials)
        try:
            return runtime.call_soon(_health(runtime.channel)).result(timeout=30)
        finally:
            runtime.close()

    async def body():
        async with modeless_workers(credentials=server_credentials(pki / "server.pem", pki / "server.key")) as workers:
            port = workers.trainer_address.rsplit(":", 1)[1]
            checks = [
                (f"grpcs://127.0.0.1:{port}", ca, SERVING),
                (f"grpcs://localhost:{port}", ca, SERVING),
                (f"grpc://127.0.0.1:{port}", None, grpc.StatusCode.UNAVAILABLE),   # plaintext to a TLS port
                (f"127.0.0.1:{port}", None, grpc.StatusCode.UNAVAILABLE),
            ]
            for url, roots, expected in checks:
                assert await asyncio.to_thread(health_through_runtime, url, roots) == expected, url
            monkeypatch.setenv("TEMPER_TLS_CA_FILE", str(pki / "ca.pem"))  # a bare host:port with a CA is TLS
            assert await asyncio.to_thread(health_through_runtime, f"127.0.0.1:{port}") == SERVING

    run(body)


def test_the_health_probe_checks_a_tls_server(pki):
    credentials = server_credentials(pki / "server.pem", pki / "server.key", pki / "ca.pem")

    async def body():
        async with modeless_workers(credentials=credentials) as workers:
            address = workers.trainer_address
            mutual = ["--ca", str(pki / "ca.pem"), "--cert", str(pki / "client.pem"), "--key", str(pki / "client.key")]
            assert await asyncio.to_thread(healthcheck.main, [address, *mutual]) == 0
            assert await asyncio.to_thread(healthcheck.main, [address, "--timeout", "2"]) == 1

    run(body)
