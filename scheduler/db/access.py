"""Who may read a checkpoint, remembered between sampling calls without going stale.

Every Sample and ComputeLogprobs asks whether its checkpoint is still the caller's to read; asking
the database each time would put a query on the sampling path. So the facts that decide it (owner,
published, expiry) are kept per path here and dropped by the Store methods that change them
(``update_checkpoint``, ``delete_checkpoint_row``) once their transaction committed: an unpublish
or delete that has answered is seen by every call that starts after it. Expiry needs no event: the
expiry time is kept and compared with the clock on every use. This is exact for changes made through
this process's Store, which is where the API and the checkpoint collector make them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import datetime
from typing import Callable, NamedTuple

MAX_PATHS = 65536  # bounded: the least recently used paths are read from the database again


class ReadFacts(NamedTuple):
    owner: str
    published: bool
    expires_at: datetime | None  # timezone-aware


class ReadAccess:
    def __init__(self, clock: Callable[[], datetime], max_paths: int = MAX_PATHS):
        self.clock, self.max_paths = clock, max_paths
        self._facts: OrderedDict[str, ReadFacts] = OrderedDict()
        self._generation = 0  # bumped by every forget: a read that raced a change is not remembered
        self._lock = threading.Lock()  # Store methods run on executor threads

    def generation(self) -> int:
        return self._generation

    def may_read(self, path: str, tenant: str) -> bool | None:
        """True or False from what is remembered; None: not remembered (ask the database)."""
        with self._lock:
            facts = self._facts.get(path)
            if facts is None:
                return None
            self._facts.move_to_end(path)
        if facts.expires_at is not None and facts.expires_at <= self.clock():
            return False
        return facts.owner == tenant or facts.published

    def remember(self, path: str, facts: ReadFacts, generation: int) -> None:
        """Keep ``facts`` read from the database when ``generation()`` was ``generation``, unless a
        change was forgotten since (the read may predate it)."""
        with self._lock:
            if generation != self._generation:
                return
            self._facts[path] = facts
            self._facts.move_to_end(path)
            while len(self._facts) > self.max_paths:
                self._facts.popitem(last=False)

    def forget(self, path: str) -> None:
        with self._lock:
            self._generation += 1
            self._facts.pop(path, None)
