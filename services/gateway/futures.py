"""In-flight futures: the only state the gateway holds.

A verb's route starts its gRPC call as a task and answers ``{"request_id"}`` at once; the SDK then
long-polls retrieve_future. Entries are keyed by (API key digest, request id), so one caller can
neither see nor join another's futures; a JWT this gateway handed out counts as the key it was
exchanged for (``bind_token``). A request id is derived from what makes the request unique
(``<run>:<seq>``, ``<sampler>:<seq>``), so a resent submission joins the call already running
instead of starting a second one; a different request under an id in use (a seq reused for other
work) is refused with ALREADY_EXISTS rather than answered with the first one's result. Answered
entries are dropped shortly after they are retrieved (the grace covers a poll whose answer was lost
on the way), unretrieved ones after ``keep_seconds``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import grpc

from temper.common.strings import shown
from temper.services.gateway.errors import GatewayError

log = logging.getLogger(__name__)
RETRIEVED_GRACE_SECONDS = 60.0
MAX_BOUND_TOKENS = 100_000


@dataclass
class Entry:
    task: asyncio.Task
    fingerprint: str = ""  # of the request that started it
    created: float = field(default_factory=time.monotonic)
    retrieved: float | None = None


class Futures:
    def __init__(self, keep_seconds: float = 3600.0):
        self.keep_seconds = keep_seconds
        self._entries: dict[tuple[str, str], Entry] = {}
        # a JWT this gateway minted -> (expiry, owner of the API key it was exchanged for): the SDK renews
        # its JWT every few minutes, and a future submitted under one must be retrievable under the next
        self._token_owners: dict[str, tuple[float, str]] = {}

    def owner(self, key: str | None) -> str:
        bound = self._token_owners.get(key or "")
        if bound is not None and bound[0] > time.time():
            return bound[1]
        return hashlib.sha256((key or "").encode()).hexdigest()

    def bind_token(self, token: str, key: str, expires_unix: float) -> None:
        """Futures submitted with ``token`` belong to ``key``'s owner (the gateway just exchanged ``key``
        for it, so the binding is as trustworthy as the key). A token minted elsewhere stays its own owner."""
        if len(self._token_owners) >= MAX_BOUND_TOKENS:
            now = time.time()
            self._token_owners = {t: b for t, b in self._token_owners.items() if b[0] > now}
            if len(self._token_owners) >= MAX_BOUND_TOKENS:
                self._token_owners.clear()
        self._token_owners[token] = (expires_unix, self.owner(key))

    def submit(self, key: str | None, request_id: str, work: Callable[[], Awaitable[Any]], fingerprint: str = "") -> str:
        """Start ``work()`` under ``request_id`` unless that request (same ``fingerprint``) is already
        running or answered."""
        slot = (self.owner(key), request_id)
        entry = self._entries.get(slot)
        if entry is None:
            task = asyncio.get_running_loop().create_task(work(), name=f"gateway {shown(request_id)}")
            self._entries[slot] = Entry(task, fingerprint)
        elif entry.fingerprint != fingerprint:
            raise GatewayError(grpc.StatusCode.ALREADY_EXISTS, f"request {shown(request_id)} was already made with another "
                                                               "body (a seq_id is used once per training run or sampler)")
        return request_id

    def __len__(self) -> int:
        return len(self._entries)

    async def wait(self, key: str | None, request_id: str, timeout: float) -> Entry | None:
        """The entry once done, or still running after ``timeout`` seconds (the long poll); None if unknown."""
        entry = self._entries.get((self.owner(key), request_id))
        if entry is None:
            return None
        if not entry.task.done():
            await asyncio.wait([entry.task], timeout=timeout)
        if entry.task.done():
            entry.retrieved = entry.retrieved or time.monotonic()
        return entry

    def sweep(self, now: float | None = None) -> int:
        """Drop answered entries retrieved a while ago and any left unretrieved too long."""
        now = time.monotonic() if now is None else now
        stale = [slot for slot, e in self._entries.items()
                 if (e.retrieved is not None and now - e.retrieved > RETRIEVED_GRACE_SECONDS)
                 or (e.task.done() and now - e.created > self.keep_seconds)]
        for slot in stale:
            del self._entries[slot]
        wall = time.time()
        for token in [t for t, (expires, _) in self._token_owners.items() if expires <= wall]:
            del self._token_owners[token]
        return len(stale)

    async def sweep_forever(self, interval: float = 15.0) -> None:
        while True:
            await asyncio.sleep(interval)
            if dropped := self.sweep():
                log.debug("dropped %d answered futures", dropped)

    def cancel_all(self) -> None:
        for entry in self._entries.values():
            entry.task.cancel()
