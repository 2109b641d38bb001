"""Who is calling the public API: the tenant of the call's API key, and nothing the caller claims.

``ApiKeyAuth`` is the server's authenticate hook (common/errors.py runs it before every handler);
the handler reads the result with ``caller()`` (the tenant), ``caller_identity()`` (the key: id,
prefix, role) or ``caller_actor()`` (who, for the audit log); ``require_admin()`` refuses a tenant's
key with PERMISSION_DENIED. With auth disabled the one caller is an admin (a single-user laptop). Keys are looked up in the database and remembered
for ``cache_seconds``, so a revoked key stops working within that time on a running scheduler.
A JWT from the key-for-token exchange (jwt_tokens.py) is taken in place of its key: its signature and
expiry are checked, then its key must be live, so revoking the key ends its tokens within that time too.
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from typing import Literal

import grpc

from temper.common.auth import bearer_token, is_open_method
from temper.common.errors import PermissionDenied, Unauthenticated
from temper.scheduler.db import keys
from temper.scheduler.db.audit import Actor
from temper.scheduler.db.tenancy import KeyIdentity
from temper.scheduler.tenancy.jwt_tokens import LEEWAY_SECONDS, InvalidToken, JwtKeys, looks_like_jwt

AuthMode = Literal["api_key", "disabled"]
LOCAL_TENANT = "default"  # the one tenant of a scheduler with auth disabled
MAX_CACHED_KEYS = 10_000
UNKNOWN_KEY_SECONDS = 1.0  # unknown keys are remembered briefly too: guessing costs no database queries

_caller: ContextVar[str] = ContextVar("temper_caller")
_identity: ContextVar[KeyIdentity] = ContextVar("temper_caller_key")
_by_token: ContextVar[bool] = ContextVar("temper_caller_by_token", default=False)


def caller_used_token() -> bool:
    """Whether this call came with a JWT (jwt_tokens.py) rather than the API key itself."""
    return _by_token.get()


def caller() -> str:
    """The calling tenant (set by the authenticate hook for this call)."""
    try:
        return _caller.get()
    except LookupError:
        raise Unauthenticated("the call was not authenticated") from None


def caller_identity() -> KeyIdentity:
    """The calling key (an in-process caller set with set_caller alone: key 0, not an admin)."""
    tenant = caller()
    identity = _identity.get(None)
    return identity if identity is not None and identity.tenant == tenant else KeyIdentity(tenant, 0, "", False)


def caller_key_prefix(tenant: str) -> str:
    """The calling key's prefix when it speaks for ``tenant``, for the audit log of what submitted work
    changes ("" for an in-process caller without a key)."""
    try:
        return caller_identity().prefix if caller() == tenant else ""
    except Unauthenticated:
        return ""


def caller_actor() -> Actor:
    """Who the audit log names for this call: the key's prefix and tenant."""
    identity = caller_identity()
    return Actor.api(identity.prefix, identity.tenant)


def require_admin(what: str) -> KeyIdentity:
    identity = caller_identity()
    if not identity.is_admin:
        raise PermissionDenied(f"{what} needs an admin key (python -m temper.scheduler.admin create-key --admin); "
                               f"key {identity.prefix or '?'}… is not one")
    return identity


def set_caller(tenant: str, identity: KeyIdentity | None = None):
    """For in-process callers and tests; returns the token reset_caller takes."""
    if identity is not None:
        _identity.set(identity)
    return _caller.set(tenant)


def reset_caller(token) -> None:
    _caller.reset(token)


# Authorized by the signed token they carry (download_tokens.py), not by an API key: a signed URL
# is fetched by whoever holds it (a browser, curl), keyless by design.
SIGNED_METHODS = frozenset({"/temper.v1.Temper/ReadSignedCheckpointFile"})


class ApiKeyAuth:
    def __init__(self, store, mode: AuthMode = "api_key", cache_seconds: float = 10.0, tokens: JwtKeys | None = None):
        self.store = store
        self.mode = mode
        self.cache_seconds = cache_seconds
        self.tokens = tokens  # verifies JWTs sent in place of a key; None: only API keys are taken
        # the key as sent -> (until, its identity or refusal): a dict lookup per call, no hash of the key to compute
        self._cache: dict[str, tuple[float, KeyIdentity | Unauthenticated]] = {}

    async def __call__(self, method: str, context: grpc.aio.ServicerContext) -> None:
        if is_open_method(method) or method in SIGNED_METHODS:
            return
        if self.mode == "disabled":
            _identity.set(KeyIdentity(LOCAL_TENANT, 0, "", True))
            _caller.set(LOCAL_TENANT)
            return
        key = bearer_token(context)
        if key is None:
            raise Unauthenticated("no API key: send `authorization: Bearer <key>` metadata "
                                  "(a key comes from `python -m temper.scheduler.admin create-key --tenant <name>`)")
        identity = await self.identity(key)
        _identity.set(identity)
        _caller.set(identity.tenant)
        _by_token.set(not key.startswith(keys.PREFIX))

    def forget(self, key_sha256: str, key_id: int | None = None) -> None:
        """Drop a key, and the tokens of key ``key_id``, from the cache (it was just revoked here): their
        next call is looked up again."""
        for key in [key for key, (_, found) in self._cache.items()
                    if (key_id is not None and isinstance(found, KeyIdentity) and found.key_id == key_id)
                    or keys.digest(key) == key_sha256]:
            del self._cache[key]

    async def tenant(self, key: str) -> str:
        return (await self.identity(key)).tenant

    async def identity(self, key: str) -> KeyIdentity:
        """The identity of an API key, or of a JWT (the key it names, which must still be live)."""
        token = self.tokens is not None and looks_like_jwt(key)
        if not token and not key.startswith(keys.PREFIX):
            raise Unauthenticated(f"API keys start with {keys.PREFIX!r}"
                                  + (" (or send a JWT from the key-for-token exchange)" if self.tokens else ""))
        cached = self._cache.get(key)
        if cached is None or cached[0] < time.monotonic():
            try:
                cached = await (self._token_identity(key) if token else self._key_identity(key))
            except Unauthenticated as refusal:
                cached = (time.monotonic() + UNKNOWN_KEY_SECONDS, refusal)
            if len(self._cache) >= MAX_CACHED_KEYS:
                self._cache.clear()
            self._cache[key] = cached
        if isinstance(cached[1], Unauthenticated):
            raise type(cached[1])(cached[1].message)
        return cached[1]

    async def _key_identity(self, key: str) -> tuple[float, KeyIdentity]:
        return time.monotonic() + self.cache_seconds, await asyncio.to_thread(self.store.key_identity, key)

    async def _token_identity(self, token: str) -> tuple[float, KeyIdentity]:
        """Signature and expiry (no query once the signing key is cached), then the one lookup an API key
        costs too: the key the token names must be live. Trusted until either check is due again."""
        claims = await self.tokens.verify(token)
        live = await asyncio.to_thread(self.store.key_identity_by_id, claims.key_id)
        if live.tenant != claims.tenant:
            raise InvalidToken("the token's tenant is not its API key's")
        left = claims.expires_unix + LEEWAY_SECONDS - time.time()
        return time.monotonic() + min(self.cache_seconds, left), live
