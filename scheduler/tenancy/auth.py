"""Who is calling the public API: the tenant of the call's API key, and nothing the caller claims.

``ApiKeyAuth`` is the server's authenticate hook (common/errors.py runs it before every handler);
the handler reads the result with ``caller()``. Keys are looked up in the database and remembered
for ``cache_seconds``, so a revoked key stops working within that time on a running scheduler.
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from typing import Literal

import grpc

from temper.common.auth import bearer_token, is_open_method
from temper.common.errors import Unauthenticated
from temper.scheduler.db import keys

AuthMode = Literal["api_key", "disabled"]
LOCAL_TENANT = "default"  # the one tenant of a scheduler with auth disabled
MAX_CACHED_KEYS = 10_000
UNKNOWN_KEY_SECONDS = 1.0  # unknown keys are remembered briefly too: guessing costs no database queries

_caller: ContextVar[str] = ContextVar("temper_caller")


def caller() -> str:
    """The calling tenant (set by the authenticate hook for this call)."""
    try:
        return _caller.get()
    except LookupError:
        raise Unauthenticated("the call was not authenticated") from None


def set_caller(tenant: str):
    """For in-process callers and tests; returns the token reset_caller takes."""
    return _caller.set(tenant)


def reset_caller(token) -> None:
    _caller.reset(token)


class ApiKeyAuth:
    def __init__(self, store, mode: AuthMode = "api_key", cache_seconds: float = 10.0):
        self.store = store
        self.mode = mode
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[float, str | Unauthenticated]] = {}  # key digest -> (until, tenant or refusal)

    async def __call__(self, method: str, context: grpc.aio.ServicerContext) -> None:
        if is_open_method(method):
            return
        if self.mode == "disabled":
            _caller.set(LOCAL_TENANT)
            return
        key = bearer_token(context)
        if key is None:
            raise Unauthenticated("no API key: send `authorization: Bearer <key>` metadata "
                                  "(a key comes from `python -m temper.scheduler.admin create-key --tenant <name>`)")
        _caller.set(await self.tenant(key))

    async def tenant(self, key: str) -> str:
        if not key.startswith(keys.PREFIX):
            raise Unauthenticated(f"API keys start with {keys.PREFIX!r}")
        digest = keys.digest(key)
        cached = self._cache.get(digest)
        if cached is None or cached[0] < time.monotonic():
            try:
                cached = (time.monotonic() + self.cache_seconds, await asyncio.to_thread(self.store.tenant_for_key, key))
            except Unauthenticated as refusal:
                cached = (time.monotonic() + UNKNOWN_KEY_SECONDS, refusal)
            if len(self._cache) >= MAX_CACHED_KEYS:
                self._cache.clear()
            self._cache[digest] = cached
        if isinstance(cached[1], Unauthenticated):
            raise Unauthenticated(cached[1].message)
        return cached[1]
