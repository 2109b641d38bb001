"""Session expiry (issue 33): a session whose client stopped sending heartbeats (the SDK sends one
every 10 s) and that does no work is closed as ``expired`` after ``session_expire_seconds``. Its checkpoints stay; its runs
take no more work and its sampling clients answer as a closed session's do (the same release as
CloseSession's: ``TemperServicer.release_session``).

Every replica runs the sweep. The expiring itself is one UPDATE ... RETURNING (``Store.expire_sessions``),
so two replicas at once expire and audit each session once; each replica then also releases the
sessions any replica expired since its last look (``expired_since``), since the in-memory state it
releases is its own.

A replica expires nothing until it has reached the database for ``expire_seconds`` without a failure
(since its start, or since a failed sweep): heartbeats that could not be recorded while the database
or this process was down must not read as silence afterwards. Live clients heartbeat again within
10 s, long before that."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Callable

from temper.common.errors import TemperError
from temper.scheduler.db.outage import now

log = logging.getLogger(__name__)


def sweep_interval(expire_seconds: float, interval_seconds: float = 0.0) -> float:
    """The configured interval, or a tenth of the timeout between 1 and 30 s."""
    return interval_seconds if interval_seconds > 0 else min(30.0, max(1.0, expire_seconds / 10))


class SessionExpiry:
    def __init__(self, store, release: Callable[[str], None], expire_seconds: float, interval_seconds: float = 0.0):
        self.store = store
        self.release = release
        self.expire_seconds = expire_seconds
        self.interval = sweep_interval(expire_seconds, interval_seconds)
        self._since = now()
        self.healthy_since = time.monotonic()  # reset by a failed sweep (see the module's note)

    async def run_forever(self) -> None:
        if self.expire_seconds <= 0:
            return  # expiry off
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep_once()
            except TemperError as exc:  # a database outage: the next sweep tries again
                self.healthy_since = time.monotonic()
                log.warning("session expiry sweep failed: %s", exc)
            except Exception:  # never let one bad sweep end expiry for the process's life
                self.healthy_since = time.monotonic()
                log.exception("session expiry sweep failed")

    async def sweep_once(self) -> list[str]:
        """Expires what is due; releases what any replica expired since the last sweep. Returns the
        sessions this call expired."""
        looked = now()
        settled = time.monotonic() - self.healthy_since >= self.expire_seconds
        expired = await asyncio.to_thread(self.store.expire_sessions, self.expire_seconds) if settled else []
        # a margin for clock differences between replicas: releasing a session twice is harmless
        seen = await asyncio.to_thread(self.store.expired_since, self._since - timedelta(seconds=2 * self.interval))
        self._since = looked
        for session_id in sorted(set(expired) | set(seen)):
            self.release(session_id)
        if expired:
            log.info("expired %d session(s) without a heartbeat for %.0f s", len(expired), self.expire_seconds)
        return expired
