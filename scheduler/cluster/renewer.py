"""The renewer: a thread that renews a replica's leases every third of the ttl, apart from the event
loop. A scheduler busy on its event loop (a burst of verbs, a slow callback) delays the ownership
rounds; its leases must not run out for that, or the replica stops and its lanes change hands under
load. Threads get the interpreter every few milliseconds whatever the loop does. The rounds on the
event loop still take, give up and report health; both sides renew, which is harmless (the same
token, extended again)."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from temper.common.errors import LeaseLost, TemperError

log = logging.getLogger(__name__)


class Renewable(Protocol):
    owner: str

    def renew_now(self) -> None: ...


class Renewer:
    def __init__(self, ownership: Renewable, every: float, on_lost: Callable[[], None]):
        self.ownership, self.every, self.on_lost = ownership, every, on_lost
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-renewer {ownership.owner}", daemon=True)
        self._loop = None

    def start(self) -> None:
        import asyncio

        self._loop = asyncio.get_running_loop()  # on_lost runs there
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.every):
            try:
                self.ownership.renew_now()
            except LeaseLost:
                if not self._stopped.is_set():
                    self._loop.call_soon_threadsafe(self.on_lost)
                return
            except TemperError as exc:  # the database is unavailable: the rounds report it (health)
                log.debug("replica %s: renewal failed: %s", self.ownership.owner, exc.message)
            except Exception:  # noqa: BLE001 - a bug here must not end renewals silently
                log.exception("replica %s: renewal failed", self.ownership.owner)
