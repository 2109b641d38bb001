"""One way to resend a call that failed transiently: exponential backoff with jitter, until a deadline.

The scheduler resends trainer calls, database writes and sampler calls this way; the gateway resends
verbs to the scheduler. Each call site decides what counts as transient (``retryable``) and what to
do between attempts (``between``: log, re-pick a worker); this module decides only when to try again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable, TypeVar

from temper.common.errors import Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

Retryable = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]


def _is_retryable(retryable: Retryable, exc: BaseException) -> bool:
    if isinstance(retryable, (type, tuple)):
        return isinstance(exc, retryable)
    return retryable(exc)


async def retry(attempt: Callable[[], Awaitable[T]], *, seconds: float | None, retryable: Retryable = Unavailable,
                first_delay: float = 0.2, max_delay: float = 5.0, jitter: float = 0.5,
                between: Callable[[BaseException, float], Awaitable[None] | None] | None = None, what: str = "",
                from_first_failure: bool = False, clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                rand: Callable[[], float] = random.random) -> T:
    """``attempt()``'s result, calling it again while it raises a ``retryable`` error.

    The pause before attempt n+1 is ``first_delay * 2**n`` (at most ``max_delay``), stretched by up to
    ``jitter`` of itself so that many callers that failed together do not come back together. No
    attempt starts after the deadline, ``seconds`` from the first attempt (``from_first_failure``: from
    the first failure, for a call that may rightly wait long before it fails); past it the last error
    is raised. ``seconds=None``: no deadline (a write that must not be lost). Other errors are raised
    at once. ``between(error, pause)`` runs before each pause; with ``what``, each resend is logged.
    """
    deadline = None if seconds is None or from_first_failure else clock() + seconds
    delay = first_delay
    while True:
        try:
            return await attempt()
        except Exception as exc:  # not CancelledError: a cancelled caller is never resent
            if not _is_retryable(retryable, exc):
                raise
            if deadline is None and seconds is not None:
                deadline = clock() + seconds
            pause = delay * (1.0 + jitter * rand())
            if deadline is not None and clock() + pause > deadline:
                raise
            if between is not None:
                hooked = between(exc, pause)
                if hooked is not None:
                    await hooked
            if what:
                log.warning("%s: %s; again in %.1f s", what, getattr(exc, "message", exc), pause)
        await sleep(pause)
        delay = min(delay * 2, max_delay)
