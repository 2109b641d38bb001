"""Per-tenant limits: the tenant's own values from the database over the scheduler's defaults, and
the one-minute token windows the rate limits are measured on.

Hard limits (training runs, checkpoint storage) answer RESOURCE_EXHAUSTED naming the limit and the
use. Storage is checked with the size of the save itself, measured by the trainer before it writes:
a save that would cross the limit is refused and nothing is written. Rate limits never fail work: a tenant over its tokens per minute has its work wait in the
queue until its last minute is under the limit again (``TokenWindow.wait_seconds`` says how long).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass, fields

from temper.common.errors import HARD_LIMIT_PREFIX, ResourceExhausted
from temper.scheduler.settings import SchedulerSettings

WINDOW_SECONDS = 60.0


@dataclass(frozen=True)
class Limits:
    """0: unlimited."""

    max_training_runs: int = 0
    max_resident_adapters: int = 0
    max_queued_requests: int = 0
    train_tokens_per_minute: int = 0
    sample_tokens_per_minute: int = 0
    max_storage_bytes: int = 0


def default_limits(settings: SchedulerSettings) -> Limits:
    return Limits(
        max_training_runs=settings.default_max_training_runs, max_resident_adapters=settings.default_max_resident_adapters,
        max_queued_requests=settings.max_queued_per_tenant, train_tokens_per_minute=settings.default_train_tokens_per_minute,
        sample_tokens_per_minute=settings.default_sample_tokens_per_minute, max_storage_bytes=settings.default_max_storage_bytes,
    )


def check_hard_limit(name: str, limit: int, used: int, adding: int = 1) -> None:
    if limit and used + adding > limit:
        raise ResourceExhausted(f"{HARD_LIMIT_PREFIX}{name} = {limit} reached (in use: {used}); "
                                f"free some or ask the operator to raise it (GetUsage lists every limit)")


class Quotas:
    """Each tenant's limits, read from the database at most every ``refresh_seconds``."""

    def __init__(self, store, settings: SchedulerSettings, refresh_seconds: float = 5.0):
        self.store = store
        self.defaults = default_limits(settings)
        self.refresh_seconds = refresh_seconds
        self._cache: dict[str, tuple[float, Limits]] = {}
        self.trained = TokenWindow()
        self.sampled = TokenWindow()
        self._storage: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def storage_lock(self, tenant: str) -> asyncio.Lock:
        """Held by a named save or an import from measuring it against max_storage_bytes until its row
        is written: the tenant's concurrent saves cannot together cross the limit."""
        return self._storage[tenant]

    async def limits(self, tenant: str) -> Limits:
        cached = self._cache.get(tenant)
        if cached is None or cached[0] < time.monotonic():
            own = await asyncio.to_thread(self.store.tenant_limits, tenant)
            values = {f.name: own.get(f.name) if own.get(f.name) is not None else getattr(self.defaults, f.name) for f in fields(Limits)}
            cached = self._cache[tenant] = (time.monotonic() + self.refresh_seconds, Limits(**values))
        return cached[1]

    def cached(self, tenant: str) -> Limits:
        """Without waiting (the admission path between its check and its claim): the last read, or the defaults."""
        cached = self._cache.get(tenant)
        return cached[1] if cached is not None else self.defaults

    def train_wait(self, tenant: str) -> float:
        return self.trained.wait_seconds(tenant, self.cached(tenant).train_tokens_per_minute)

    async def wait_to_sample(self, tenant: str) -> None:
        """Sampling over the tenant's rate waits here (the caller's deadline still applies)."""
        limit = (await self.limits(tenant)).sample_tokens_per_minute
        while (wait := self.sampled.wait_seconds(tenant, limit)) > 0:
            await asyncio.sleep(min(wait, 1.0))


class TokenWindow:
    """Tokens per tenant over the last minute."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._events: dict[str, deque[tuple[float, int]]] = defaultdict(deque)

    def record(self, tenant: str, tokens: int) -> None:
        if tokens > 0:
            self._events[tenant].append((self.clock(), tokens))

    def used(self, tenant: str) -> int:
        events = self._expire(tenant)
        return sum(tokens for _, tokens in events)

    def wait_seconds(self, tenant: str, limit: int) -> float:
        """0 when under ``limit`` (0: unlimited); else until enough of the last minute's tokens age out.
        One request larger than the whole limit still runs once the window is empty."""
        if not limit:
            return 0.0
        events = self._expire(tenant)
        used = sum(tokens for _, tokens in events)
        if used < limit:
            return 0.0
        now = self.clock()
        for at, tokens in events:  # oldest first: when enough of them have aged out
            used -= tokens
            if used < limit:
                return max(0.0, at + WINDOW_SECONDS - now)
        return 0.0

    def _expire(self, tenant: str) -> deque[tuple[float, int]]:
        events = self._events[tenant]
        cutoff = self.clock() - WINDOW_SECONDS
        while events and events[0][0] <= cutoff:
            events.popleft()
        return events
