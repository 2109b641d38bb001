"""The real trainer and sampler answer the scheduler only: raw stubs without the stack's internal
token, or with a wrong one, get UNAUTHENTICATED (unary and streaming calls); with it they are
served; health stays open. A sampler without a token refuses to start. Last, a stack whose
scheduler talks to its workers over mutual TLS and serves its public port over TLS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from temper.common.auth import bearer_metadata
from temper.common.tls import channel_credentials
from temper.localstack import LocalStack
from temper.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def refused(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        reply = call(*args, timeout=30, **kwargs)
        if not hasattr(reply, "ByteSize"):  # a server stream: the status comes with the first read
            list(reply)
    return info.value.code()


def test_the_trainer_answers_only_with_the_internal_token(stack):
    with grpc.insecure_channel(stack.service("trainer").address) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        request = trainer_pb2.GetModelInfoRequest()
        assert refused(stub.GetModelInfo, request) == grpc.StatusCode.UNAUTHENTICATED
        assert refused(stub.GetModelInfo, request, metadata=[bearer_metadata("wrong")]) == grpc.StatusCode.UNAUTHENTICATED
        read = trainer_pb2.ReadCheckpointRequest(checkpoint_key="any")
        assert refused(stub.ReadCheckpoint, read) == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetModelInfo(request, metadata=[bearer_metadata(stack.internal_token)], timeout=30)
        assert info.vocab_size > 0 and info.base_model
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == SERVING


def test_the_sampler_answers_only_with_the_internal_token(stack):
    with grpc.insecure_channel(stack.service("sampler").address) as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        request = sampler_pb2.SamplerModelInfoRequest()
        assert refused(stub.GetModelInfo, request) == grpc.StatusCode.UNAUTHENTICATED
        assert refused(stub.GetModelInfo, request, metadata=[bearer_metadata("wrong")]) == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetModelInfo(request, metadata=[bearer_metadata(stack.internal_token)], timeout=30)
        assert info.backend == "torch" and info.base_model
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == SERVING


def test_a_sampler_without_a_token_refuses_to_start(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPER_SAMPLER_")}
    env.update(TEMPER_SAMPLER_BASE_MODEL=tiny_model_dir, TEMPER_SAMPLER_BIND="127.0.0.1:0")
    proc = subprocess.run([sys.executable, "-m", "temper.services.sampler"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "TEMPER_READY" not in proc.stdout
    assert "no internal token: set TEMPER_SAMPLER_INTERNAL_TOKEN" in proc.stderr
    assert "TEMPER_SAMPLER_INTERNAL_AUTH=disabled" in proc.stderr


def _pki(folder):
    """A CA, a certificate for 127.0.0.1 that serves and a client one (openssl command line)."""
    assert shutil.which("openssl"), "this test makes its certificates with the openssl command"

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=ca", "-keyout", "ca.key", "-out", "ca.pem")
    (folder / "peer.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-new", *ec, "-subj", "/CN=peer", "-keyout", "peer.key", "-out", "peer.csr")
    openssl("x509", "-req", "-in", "peer.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", "peer.ext", "-out", "peer.pem")
    return {name: str(folder / name) for name in ("ca.pem", "peer.pem", "peer.key")}


def test_a_stack_over_mutual_tls(tiny_model_dir, tmp_path):
    files = _pki(tmp_path)
    env = {"TEMPER_SCHEDULER_TLS_CERT_FILE": files["peer.pem"], "TEMPER_SCHEDULER_TLS_KEY_FILE": files["peer.key"],
           "TEMPER_SCHEDULER_INTERNAL_TLS_CA_FILE": files["ca.pem"], "TEMPER_SCHEDULER_INTERNAL_TLS_CERT_FILE": files["peer.pem"],
           "TEMPER_SCHEDULER_INTERNAL_TLS_KEY_FILE": files["peer.key"]}
    for role in ("TRAINER", "SAMPLER"):
        env.update({f"TEMPER_{role}_TLS_CERT_FILE": files["peer.pem"], f"TEMPER_{role}_TLS_KEY_FILE": files["peer.key"],
                    f"TEMPER_{role}_TLS_CLIENT_CA_FILE": files["ca.pem"]})
    with LocalStack(tiny_model_dir, tmp_path / "stack", extra_env=env, num_threads=1) as local:
        address = local.start()
        tls = channel_credentials(files["ca.pem"])
        with grpc.secure_channel(address, tls) as channel:  # SERVING: the scheduler reached both workers
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            assert any(reply.status == SERVING for reply in watch)
            watch.cancel()
        with grpc.insecure_channel(address) as channel:
            assert refused(health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest()) == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(local.service("trainer").address, tls) as channel:  # no client certificate
            assert refused(health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest()) == grpc.StatusCode.UNAVAILABLE
