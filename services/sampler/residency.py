"""Which adapters a sampler keeps loaded: at most ``max_adapters`` (and ``max_bytes`` when set),
the least recently used out first, never one in use.

Pure bookkeeping, behind one lock: requests pin and release on the event loop (a request that follows
an in-flight target also pins the adapters it moves to, on the compute thread), loads reserve room on
the servicer's one compute thread (so loads never interleave). An adapter is *pinned* while a
request that names it is queued or decoding; pinned adapters are never chosen to make room. A victim
is forgotten here, under the lock, before it is dropped, so no request can pin it after it was chosen.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from temper.common.errors import AdapterNotLoaded, InvalidArgument, ResourceExhausted, Unavailable


@dataclass
class _Entry:
    size: int            # bytes of the pushed adapter files
    pins: int = 0
    ready: bool = False  # its weights are in (a new key is not, until its load finishes)
    retiring: bool = False  # being dropped: no new uses


class Residency:
    def __init__(self, max_adapters: int, max_bytes: int = 0):
        if max_adapters < 1 or max_bytes < 0:
            raise ValueError("max_adapters must be >= 1 and max_bytes >= 0")
        self.max_adapters = max_adapters
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # least recently used first
        self._lock = threading.Lock()

    # ---- reading ------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Least recently used first."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    def pins(self, key: str) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return entry.pins if entry else 0

    def usable(self, key: str) -> bool:
        """Loaded, and not being dropped (``use`` would pin it)."""
        with self._lock:
            return self._usable(key)

    def _usable(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready and not entry.retiring

    # ---- uses ---------------------------------------------------------------------------------

    def adopt(self, key: str, size: int = 0) -> None:
        """An adapter the backend already holds (loaded before the servicer started)."""
        with self._lock:
            self._entries[key] = _Entry(size, ready=True)

    def use(self, key: str) -> "_Entry":
        """Pin ``key`` for one request and make it the most recently used; AdapterNotLoaded if it is
        not here (or is still loading, or is being dropped). Give the returned pin to ``release``."""
        with self._lock:
            if not self._usable(key):
                raise AdapterNotLoaded(key)
            entry = self._entries[key]
            entry.pins += 1
            self._entries.move_to_end(key)
            return entry

    def release(self, pin: "_Entry") -> int:
        """Unpin one use (of the entry it pinned, even if that one has been replaced since); returns
        the pins left on it."""
        with self._lock:
            pin.pins -= 1
            return pin.pins

    # ---- loading and dropping -----------------------------------------------------------------

    def reserve(self, key: str, size: int, keep: frozenset = frozenset()) -> list[str]:
        """Hold a place for ``key`` (``size`` bytes; a key already here is being replaced, and stays
        usable meanwhile). Returns the adapters to drop first, least recently used first, already
        forgotten here; never one in ``keep`` (the adapters of a batch that is decoding). Nothing
        changes when there is no room: InvalidArgument if ``size`` alone is over the byte bound,
        ResourceExhausted if the adapters in use (or kept) leave no room (retry later)."""
        if self.max_bytes and size > self.max_bytes:
            raise InvalidArgument(f"adapter {key} has {size} bytes; this sampler holds at most {self.max_bytes}")
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None and existing.retiring:
                raise Unavailable(f"checkpoint {key} is being dropped on this sampler; retry")
            count = len(self._entries) + (existing is None)
            total = self._bytes() - (existing.size if existing else 0) + size
            victims = []
            for other, entry in self._entries.items():
                if self._fits(count, total):
                    break
                if other == key or other in keep or entry.pins or not entry.ready or entry.retiring:
                    continue
                victims.append(other)
                count, total = count - 1, total - entry.size
            if not self._fits(count, total):
                raise ResourceExhausted(
                    f"no room for adapter {key}: the {len(self._entries)} adapters here ({self._bytes()} bytes) are in use "
                    f"(at most {self.max_adapters}{f' and {self.max_bytes} bytes' if self.max_bytes else ''}); retry")
            for other in victims:
                del self._entries[other]
            if existing is None:
                self._entries[key] = _Entry(size)
            else:
                existing.size = size
                self._entries.move_to_end(key)
            return victims

    def _fits(self, count: int, total: int) -> bool:
        return count <= self.max_adapters and (not self.max_bytes or total <= self.max_bytes)

    def loaded(self, key: str) -> None:
        """``key``'s weights are in: usable from now on."""
        with self._lock:
            self._entries[key].ready = True

    def forget(self, key: str) -> None:
        """It is gone (its load failed, or it is being dropped)."""
        with self._lock:
            self._entries.pop(key, None)

    def retire(self, key: str) -> None:
        """No new uses of ``key``: it is about to be dropped (once its pins are gone); AdapterNotLoaded
        if it is not here."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise AdapterNotLoaded(key)
            entry.retiring = True
