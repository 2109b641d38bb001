"""The sampler's in-flight targets (docs/async_rl.md): per training run, the newest version it was told
of (``Sampler.SetInflightTarget``, or a request naming a newer one), and the follow hook that moves a
running in-flight request onto it between decode steps.

Written on the event loop, read on the compute thread (between decode steps): behind one lock. The
table only moves forward: a version not newer than the one held changes nothing."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from temper.common.errors import AdapterNotLoaded, InvalidArgument
from temper.services.sampler.backend import WeightsVersion


@dataclass(frozen=True)
class Target:
    """A run's in-flight version on this sampler: the checkpoint key its adapter was pushed under."""

    checkpoint_key: str
    weights: WeightsVersion


def check_target(run: str, checkpoint_key: str, weights: WeightsVersion) -> None:
    """InvalidArgument unless it names a run, an adapter and an in-flight version (> 0)."""
    if not run:
        raise InvalidArgument("an in-flight target names its training run (training_run_id / inflight_run)")
    if not checkpoint_key:
        raise InvalidArgument(f"the in-flight target of run {run} names no checkpoint (an in-flight version is an adapter)")
    if weights.version <= 0:
        raise InvalidArgument(f"in-flight versions count from 1; run {run}'s target names version {weights.version}")


class InflightTargets:
    def __init__(self):
        self._held: dict[str, Target] = {}
        self._lock = threading.Lock()

    def get(self, run: str) -> Target | None:
        with self._lock:
            return self._held.get(run)

    def advance(self, run: str, checkpoint_key: str, weights: WeightsVersion) -> Target:
        """Hold ``weights`` for ``run`` if it is newer than what is held; returns what is held now."""
        check_target(run, checkpoint_key, weights)
        with self._lock:
            held = self._held.get(run)
            if held is None or weights.version > held.weights.version:
                held = self._held[run] = Target(checkpoint_key, weights)
            return held

    def newer(self, run: str, version: int) -> Target | None:
        """The target held for ``run`` if it is newer than ``version``."""
        with self._lock:
            held = self._held.get(run)
            return held if held is not None and held.weights.version > version else None


class Follower:
    """One in-flight request's ``retarget`` (backend.Retarget), called on the compute thread once per
    decode step: moves it to its run's target when that is newer than the version it decodes with,
    pinning the new adapter (``use``: Residency.use) so it stays loaded until the request ends. A
    target whose adapter is not usable here (being dropped) is not followed (asked again next step).
    ``close`` (on the event loop, when the request ends) returns the pins it took; after it, nothing
    more is pinned."""

    def __init__(self, targets: InflightTargets, run: str, use: Callable[[str], object]):
        self.targets, self.run, self._use = targets, run, use
        self._pins: list[tuple[str, object]] = []
        self._keys: set[str] = set()
        self._closed = False
        self._lock = threading.Lock()

    def __call__(self, current: WeightsVersion) -> tuple[str, WeightsVersion] | None:
        target = self.targets.newer(self.run, current.version)
        if target is None:
            return None
        with self._lock:
            if self._closed:
                return None
            if target.checkpoint_key not in self._keys:
                try:
                    self._pins.append((target.checkpoint_key, self._use(target.checkpoint_key)))
                except AdapterNotLoaded:
                    return None
                self._keys.add(target.checkpoint_key)
        return target.checkpoint_key, target.weights

    def close(self) -> list[tuple[str, object]]:
        with self._lock:
            self._closed = True
            pins, self._pins = self._pins, []
            return pins
