"""JWTs in place of API keys (scheduler/tenancy/jwt_tokens.py, auth.py): what a token carries (the
claims the tinker SDK's whoami reads), refusals (tampered, expired, foreign, malformed, a retired or
unknown signing key), and through ApiKeyAuth on a real SQLite store: another replica verifying the
first one's token, rotation, revocation ending tokens, and no database query per call once cached."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import timedelta

import jwt as pyjwt
import pytest
from sqlalchemy import update

from temper.common.errors import Unauthenticated
from temper.scheduler.db import models as m
from temper.scheduler.db.signing_keys import SigningKey
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.db.tenancy import KeyIdentity
from temper.scheduler.tenancy.auth import ApiKeyAuth
from temper.scheduler.tenancy.jwt_tokens import InvalidToken, JwtKeys, looks_like_jwt, make_token, read_token, token_kid
from temper.services.gateway.app import MAX_KEY_CHARS
from temper.services.gateway.futures import Futures

KEY = SigningKey(kid="k1", secret=b"s" * 32, purpose="jwt", created_unix=time.time())
ALICE = KeyIdentity("alice", 7, "tml-AbCdEfGh", False)


def payload(token: str) -> dict:
    part = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def with_payload(token: str, **changes) -> str:
    header, _, signature = token.split(".")
    body = base64.urlsafe_b64encode(json.dumps({**payload(token), **changes}).encode()).rstrip(b"=").decode()
    return f"{header}.{body}.{signature}"


def test_a_token_carries_the_tenant_key_and_the_claims_the_sdk_whoami_reads():
    token = make_token(KEY, ALICE, 900)
    assert looks_like_jwt(token) and not looks_like_jwt("tml-AbCdEfGh") and token_kid(token) == "k1"
    claims = read_token(token, KEY)
    assert (claims.tenant, claims.key_id, claims.key_prefix) == ("alice", 7, "tml-AbCdEfGh")
    assert abs(claims.expires_unix - (time.time() + 900)) < 5
    longest = make_token(KEY, KeyIdentity("t" * 128, 2**31 - 1, "tml-AbCdEfGh", True), 86400)
    assert len(longest) <= MAX_KEY_CHARS  # the gateway passes the largest token on
    sdk = pytest.importorskip("tinker.lib.public_interfaces.rest_client")  # the `gateway` extra
    me = sdk._whoami_response_from_jwt(token)  # the unmodified SDK's reading of it
    assert me.org_urn == "tml:organization:alice" and me.user_urn == "temper:api_key:tml-AbCdEfGh" and me.email is None


def test_tampered_expired_foreign_and_malformed_tokens_are_invalid_tokens():
    token = make_token(KEY, ALICE, 900)
    refusals = {
        "refused": [with_payload(token, tenant="bob"), with_payload(token, key_id=8), token[:-2] + "xx",
                    make_token(SigningKey("k1", b"o" * 32, "jwt", 0.0), ALICE, 900),  # right kid, wrong secret
                    pyjwt.encode({**payload(token), "iss": "elsewhere"}, KEY.secret, algorithm="HS256", headers={"kid": "k1"})],
        "expired": [make_token(KEY, ALICE, 120, now=time.time() - 600)],
    }
    for match, tokens in refusals.items():
        for bad in tokens:
            with pytest.raises(InvalidToken, match=match):
                read_token(bad, KEY)
    with pytest.raises(InvalidToken, match="unknown or retired"):
        read_token(token, None)
    for bad in ("eyJ.x.y", pyjwt.encode({"a": 1}, "k" * 32, algorithm="HS256"),  # no kid
                pyjwt.encode(payload(token), None, algorithm="none", headers={"kid": "k1"})):
        with pytest.raises(InvalidToken):
            token_kid(bad)
    assert issubclass(InvalidToken, Unauthenticated)  # UNAUTHENTICATED on the wire


class CountingStore(Store):
    """The real store, counting the calls a token check makes."""

    def __init__(self, url):
        super().__init__(url)
        self.calls = 0

    def key_identity_by_id(self, key_id):
        self.calls += 1
        return super().key_identity_by_id(key_id)

    def signing_key(self, *args):
        self.calls += 1
        return super().signing_key(*args)


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'jwt.db'}"
    upgrade_schema(url)
    store = CountingStore(url)
    yield store
    store.engine.dispose()


def replica(store, cache_seconds=60.0, lifetime=900.0, rotate=86400.0) -> ApiKeyAuth:
    return ApiKeyAuth(store, cache_seconds=cache_seconds, tokens=JwtKeys(store, lifetime, rotate))


def test_replicas_share_keys_a_revoked_key_ends_its_tokens_and_checks_are_cached(store):
    key, row = store.create_api_key("alice")
    issuing, other = replica(store), replica(store)
    identity = asyncio.run(issuing.identity(key))
    token, expires = asyncio.run(issuing.tokens.issue(identity))
    assert abs(expires - time.time() - 900) < 5
    store.calls = 0
    assert asyncio.run(other.identity(token)) == identity  # another replica: signing key read from the database
    assert store.calls == 2  # the signing key once, the key's liveness once (what an API key costs)
    for _ in range(3):
        assert asyncio.run(other.identity(token)).tenant == "alice"
    assert store.calls == 2  # then from memory
    assert asyncio.run(other.identity(asyncio.run(other.tokens.issue(identity))[0])).key_id == row.id
    assert store.calls == 3  # a new token of a known signing key: only the liveness lookup

    store.revoke_api_key(str(row.id))
    issuing.forget(row.key_sha256, row.id)  # what RevokeApiKey does on the replica that revoked it
    with pytest.raises(Unauthenticated, match="revoked"):
        asyncio.run(issuing.identity(token))
    assert asyncio.run(other.identity(token)).tenant == "alice"  # another replica: until its cache time ...
    with pytest.raises(Unauthenticated, match="revoked"):
        asyncio.run(replica(store, cache_seconds=0.0).identity(token))  # ... then refused there too


def test_rotation_keeps_older_tokens_valid_until_their_key_retires(store):
    key, _ = store.create_api_key("alice")
    auth = replica(store, lifetime=900.0, rotate=3600.0)
    identity = asyncio.run(auth.identity(key))
    old, _ = asyncio.run(auth.tokens.issue(identity))
    with store.sessions.begin() as db:  # the key is past its rotation period
        db.execute(update(m.SigningKey).values(created_at=m.utcnow() - timedelta(seconds=4000)))
    auth.tokens._current = None  # as after a restart; a running replica re-reads when its copy is due
    new, _ = asyncio.run(auth.tokens.issue(identity))
    assert token_kid(new) != token_kid(old)
    fresh = replica(store)
    assert asyncio.run(fresh.identity(old)) == asyncio.run(fresh.identity(new)) == identity
    with store.sessions.begin() as db:  # past rotation + lifetime: nothing it signed can be valid
        db.execute(update(m.SigningKey).where(m.SigningKey.kid == token_kid(old))
                   .values(created_at=m.utcnow() - timedelta(seconds=3600 + 900 + 60)))
    with pytest.raises(InvalidToken, match="unknown or retired"):
        asyncio.run(replica(store, lifetime=900.0, rotate=3600.0).identity(old))
    forged = make_token(SigningKey("nope", b"x" * 32, "jwt", 0.0), identity, 900)
    store.calls = 0
    for _ in range(3):
        with pytest.raises(InvalidToken):
            asyncio.run(fresh.identity(forged))
    assert store.calls == 1  # an unknown kid is remembered: forged headers cost no queries


def test_a_gateway_counts_a_token_it_minted_as_its_key_for_futures():
    futures = Futures()
    token = make_token(KEY, ALICE, 900)
    assert futures.owner(token) != futures.owner("tml-key")
    futures.bind_token(token, "tml-key", time.time() + 900)
    assert futures.owner(token) == futures.owner("tml-key")
    expired = make_token(KEY, ALICE, 900, now=time.time() - 1000)
    futures.bind_token(expired, "tml-key", time.time() - 1)
    assert futures.owner(expired) != futures.owner("tml-key")
    futures.sweep()
    assert expired not in futures._token_owners and token in futures._token_owners
