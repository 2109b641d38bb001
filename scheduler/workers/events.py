"""Recent failures and recoveries of the scheduler's workers and runs, for the operator's status
(GetClusterStatus): a bounded ring in memory, like the Prometheus series in ``metrics`` one per
process, written beside the log line each event already had (a worker down, restarted or heard
again; a run's adapter lost, restored, moved or refused). Nothing reads it on a hot path; a
restarted scheduler starts with an empty ring (the log keeps the history).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

EVENTS_KEPT = 256
KINDS = ("failure", "recovery")


@dataclass(frozen=True)
class ClusterEvent:
    at: float         # time.time()
    kind: str         # failure | recovery
    what: str
    worker: str = ""  # the worker's address, if one
    run_id: str = ""  # the training run, if one


class ClusterEvents:
    def __init__(self, kept: int = EVENTS_KEPT):
        self._ring: deque[ClusterEvent] = deque(maxlen=kept)
        self._lock = threading.Lock()  # also written from store threads' callers: cheap and safe

    def add(self, kind: str, what: str, worker: str = "", run_id: str = "") -> None:
        if kind not in KINDS:
            raise AssertionError(f"unknown cluster event kind {kind!r}")
        with self._lock:
            self._ring.append(ClusterEvent(time.time(), kind, what, worker, run_id))

    def newest_first(self, limit: int = EVENTS_KEPT) -> list[ClusterEvent]:
        with self._lock:
            return list(reversed(self._ring))[:limit]


EVENTS = ClusterEvents()


def cluster_event(kind: str, what: str, worker: str = "", run_id: str = "") -> None:
    """Record a failure or recovery in this process's ring (what GetClusterStatus shows)."""
    EVENTS.add(kind, what, worker, run_id)


class CycleRate:
    """Cycles a trainer ran (RunCycle answered): how many since start, and in the last minute."""

    WINDOW_SECONDS = 60.0

    def __init__(self, kept: int = 100_000):
        self.total = 0
        self._times: deque[float] = deque(maxlen=kept)

    def ran(self) -> None:
        self.total += 1
        self._times.append(time.monotonic())

    def last_minute(self) -> int:
        cutoff = time.monotonic() - self.WINDOW_SECONDS
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
        return len(self._times)
