"""JWT auth, the tinker SDK's default (issue 33 item 2), on one gateway stack through the unmodified SDK:

- the gateway's client config turns JWT auth on, so ``ServiceClient`` exchanges its API key at
  POST /api/v1/auth/token and trains with the JWT; ``RestClient().whoami()`` reads the tenant from it;
- a tampered or expired JWT is 401 with ``WWW-Authenticate: Bearer error="invalid_token"`` (the SDK's
  cue to exchange again), a token cannot mint another, and a raw gRPC call with a bad JWT is
  UNAUTHENTICATED while a good one is served;
- after its API key is revoked a JWT is refused with a clear message and changes nothing."""

import time

import grpc
import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.pool import NullPool

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402
from tinker.lib._jwt_auth import JwtAuthProvider  # noqa: E402

from temper.localstack import LocalStack  # noqa: E402
from temper.scheduler.db import models as m  # noqa: E402
from temper.scheduler.db import signing_keys  # noqa: E402
from temper.scheduler.db.tenancy import KeyIdentity  # noqa: E402
from temper.scheduler.tenancy.jwt_tokens import PURPOSE, make_token, token_kid  # noqa: E402
from temper.v1 import service_pb2, service_pb2_grpc  # noqa: E402

INVALID_TOKEN = 'Bearer error="invalid_token"'


@pytest.fixture(scope="module")
def stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_sdk_jwt")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("sdk-jwt"), database_url=url, num_threads=1, gateway=True) as local:
        local.start()
        yield local


def exchange(stack, key: str) -> httpx.Response:
    return httpx.post(f"{stack.gateway_url}/api/v1/auth/token", headers={"X-API-Key": key}, json={}, timeout=30)


def capabilities(stack, credential: str) -> httpx.Response:
    return httpx.get(f"{stack.gateway_url}/api/v1/get_server_capabilities", headers={"X-API-Key": credential}, timeout=30)


def raw_call(stack, credential: str):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        return service_pb2_grpc.TemperStub(channel).ListApiKeys(
            service_pb2.ListApiKeysRequest(), metadata=[("authorization", f"Bearer {credential}")], timeout=30)


def test_the_unmodified_sdk_trains_with_a_jwt_and_whoami_names_the_tenant(stack, tiny_model_dir, monkeypatch):
    for name, value in (("TINKER_BASE_URL", stack.gateway_url), ("TINKER_API_KEY", stack.key_for("jwt-alice")),
                        ("TINKER_TELEMETRY", "0")):
        monkeypatch.setenv(name, value)
    client = tinker.ServiceClient()
    try:
        assert isinstance(client.holder._default_auth, JwtAuthProvider)  # the server's config turned JWT auth on
        tc = client.create_lora_training_client(tiny_model_dir, rank=4, seed=5).result()
        tokens = [5, 17, 42, 9, 77, 3]
        datum = tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                         "weights": np.ones(len(tokens) - 1, np.float32)})
        out = tc.forward_backward([datum], "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])
        tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result()
        me = tinker.RestClient().whoami().result()
        assert me.org_urn == "tml:organization:jwt-alice" and me.user_urn.startswith("temper:api_key:tml-")
        assert me.email is None
    finally:
        client.close("success")


def test_tampered_expired_and_exchanged_tokens_are_refused_and_raw_grpc_takes_jwts(stack):
    key = stack.key_for("jwt-carol")
    answer = exchange(stack, key)
    assert answer.status_code == 200, answer.text
    token = answer.json()["jwt"]
    assert capabilities(stack, token).status_code == 200
    assert raw_call(stack, token).caller.tenant == "jwt-carol"  # raw gRPC with a JWT in place of the key

    header, payload, signature = token.split(".")
    tampered = f"{header}.{payload}.{signature[:-4]}{'AAAA' if signature[-4:] != 'AAAA' else 'BBBB'}"
    engine = create_engine(stack.database_url, poolclass=NullPool)
    try:
        with OrmSession(engine) as db:
            signing_key = signing_keys.key_by_id(db, PURPOSE, token_kid(token))
    finally:
        engine.dispose()
    identity = KeyIdentity("jwt-carol", raw_call(stack, key).caller.id, key[:12], False)
    expired = make_token(signing_key, identity, 300, now=time.time() - 3600)  # well signed, an hour too old
    for bad, reason in ((tampered, "refused"), (expired, "expired")):
        refused = capabilities(stack, bad)
        assert refused.status_code == 401 and refused.headers.get("www-authenticate") == INVALID_TOKEN, refused.text
        assert reason in refused.json()["error"]
        with pytest.raises(grpc.RpcError) as raw:
            raw_call(stack, bad)
        assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED and reason in raw.value.details()
    refused_key = capabilities(stack, "tml-not-a-key")
    assert refused_key.status_code == 401 and "www-authenticate" not in refused_key.headers  # a key is not a token

    again = exchange(stack, token)  # only the key itself mints tokens
    assert again.status_code == 403 and "send the API key" in again.json()["error"]


def count_rows(url: str) -> dict[str, int]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with OrmSession(engine) as db:
            return {model.__tablename__: db.scalar(select(func.count()).select_from(model))
                    for model in (m.Session, m.TrainingRun, m.RequestRecord, m.ApiKey, m.AuditEntry)}
    finally:
        engine.dispose()


def test_a_revoked_keys_jwt_is_refused_and_changes_nothing(stack):
    key = stack.key_for("jwt-dave")
    token = exchange(stack, key).json()["jwt"]
    assert capabilities(stack, token).status_code == 200
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        service_pb2_grpc.TemperStub(channel).RevokeApiKey(service_pb2.RevokeApiKeyRequest(key=key[:12]),
                                                          metadata=[("authorization", f"Bearer {key}")], timeout=30)
    before = count_rows(stack.database_url)
    refused = httpx.post(f"{stack.gateway_url}/api/v1/create_session", headers={"X-API-Key": token}, json={}, timeout=30)
    assert refused.status_code == 401 and "revoked" in refused.json()["error"], refused.text
    assert refused.headers.get("www-authenticate") == INVALID_TOKEN  # the SDK exchanges again, and the key is refused
    assert exchange(stack, key).status_code == 401
    assert count_rows(stack.database_url) == before
