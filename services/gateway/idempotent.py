"""Resent REST calls answered once. The SDK sends ``X-Idempotency-Key`` on every non-GET and keeps
it when it resends a call whose answer it lost (a timeout, a dropped connection). A change asked
twice that way must happen, and be logged, once: the resend gets the first call's answer.

Answers are kept in this gateway's memory for KEEP_SECONDS by (API key, idempotency key, route,
request): a refusal or failure is not kept (the resend tries again), and a gateway restart forgets
them (the scheduler's own checks still hold: a repeated publish or delete changes nothing there).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Awaitable, Callable

from fastapi import Request

KEEP_SECONDS = 3600.0
MAX_KEPT = 100_000  # answers held at once; the oldest go first


class RecentAnswers:
    def __init__(self, keep_seconds: float = KEEP_SECONDS, max_kept: int = MAX_KEPT):
        self.keep_seconds = keep_seconds
        self.max_kept = max_kept
        self.answers: dict[str, tuple[float, asyncio.Future]] = {}  # insertion order = age

    def _forget_old(self, now: float) -> None:
        for identity, (at, _) in list(self.answers.items()):
            if now - at <= self.keep_seconds and len(self.answers) < self.max_kept:
                break
            del self.answers[identity]

    async def once(self, identity: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """``make()``'s answer; a call under an identity already answered (or in flight) shares that answer."""
        now = time.monotonic()
        self._forget_old(now)
        held = self.answers.get(identity)
        if held is not None:
            return await asyncio.shield(held[1])
        future = asyncio.ensure_future(make())
        self.answers[identity] = (now, future)
        try:
            return await asyncio.shield(future)
        except BaseException:
            if future.done():  # a refusal or failure is not remembered: the resent call tries again
                self.answers.pop(identity, None)
            raise


def _answers(request: Request) -> RecentAnswers:
    state = request.app.state
    if not hasattr(state, "recent_answers"):
        state.recent_answers = RecentAnswers()
    return state.recent_answers


async def once_per_request(request: Request, key: str, what: bytes, make: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``make`` once per (key, X-Idempotency-Key, method and path, ``what``: the request as sent
    on); without the header, every call runs."""
    idempotency = request.headers.get("x-idempotency-key")
    if not idempotency:
        return await make()
    digest = hashlib.sha256("\0".join((key, idempotency, request.method, request.url.path)).encode())
    digest.update(what)
    return await _answers(request).once(digest.hexdigest(), make)
