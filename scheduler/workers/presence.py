"""Whether a base model that no trainer (or sampler) here serves now is this deployment's, its
workers on their way (wait a bounded time, then UNAVAILABLE, which clients retry), or unknown to it
(NOT_FOUND, permanent). Mixed into ``Backends``; ``samplers_of`` and ``_trainers_of`` answer with it.

Without a registry the static workers have all answered before the scheduler serves
(``Backends.wait_ready``) and no other can join: a model none of them serves is unknown. With a
registry workers join at any time, and a scheduler that has just (re)started learns them one
heartbeat at a time: each live worker's next heartbeat (every heartbeat_seconds, well within
worker_timeout_seconds) answers NOT_FOUND and it registers again. So a model is expected while the
scheduler is still learning (worker_timeout_seconds from its start), once any trainer or sampler
of it was seen (trainers and no sampler yet, or the other way round), or when the database names it
(runs and sampling clients made before a restart: ``known_models``, filled at start by app.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from temper.common.errors import NotFound, TemperError, Unavailable
from temper.scheduler.settings import SchedulerSettings


class WorkersAbsent(Unavailable):
    """No trainer (or sampler) of a model of this deployment is here now: retry."""


class ModelPresence:
    """Mixed into Backends, which provides ``settings``, ``trainers`` and ``samplers``."""

    settings: SchedulerSettings
    trainers: list
    samplers: list

    def _init_presence(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.known_models: set[str] = set()  # base models the database names (app.py)
        self._learning_until = clock() + self.settings.worker_timeout_seconds if self.settings.registry_bind else 0.0
        self._arrived = asyncio.Event()      # set (and replaced) when a worker joins: waiters look again

    def learning(self) -> bool:
        """Whether the scheduler may not have heard from every live worker yet (registry only)."""
        return self._clock() < self._learning_until

    def worker_joined(self) -> None:
        self._arrived.set()
        self._arrived = asyncio.Event()

    def _handles(self, role: str) -> list:
        return self.trainers if role == "trainer" else self.samplers

    def expects(self, base_model: str) -> bool:
        """Whether workers of ``base_model`` may still come (see the module's docstring)."""
        if not self.settings.registry_bind:
            return False
        return (self.learning() or base_model in self.known_models
                or any(w.info.base_model == base_model for w in (*self.trainers, *self.samplers)))

    def absent(self, role: str, base_model: str) -> TemperError:
        """The error for "no ``role`` of ``base_model`` is here": WorkersAbsent if expected, else NotFound."""
        if self.expects(base_model):
            why = ("the scheduler started moments ago and is still hearing from its workers" if self.learning()
                   else "the model is served here, but none of its {role}s is registered now".format(role=role))
            return WorkersAbsent(f"no {role} of base model {base_model!r} is here yet ({why}); retry")
        served = sorted({w.info.base_model for w in self._handles(role)})
        return NotFound(f"no {role} serves base model {base_model!r}; served by {role}s: {served}")

    def _incomplete(self) -> list[str]:
        """Models of this deployment (named by the database, or with a worker here) lacking a trainer or a sampler."""
        models = self.known_models | {w.info.base_model for w in (*self.trainers, *self.samplers)}
        return sorted(m for m in models if not (any(t.info.base_model == m for t in self.trainers)
                                                and any(s.info.base_model == m for s in self.samplers)))

    async def settled(self) -> None:
        """Return once every model of this deployment has a trainer and a sampler here, or once the
        scheduler stops learning (at most worker_timeout_seconds after its start): what lists the
        models (GetServerCapabilities) then shows no partial set in the window after a restart, such
        as a model missing, or trainable and not yet sampleable, because a heartbeat is still due."""
        while self.learning() and self._incomplete():
            try:
                await asyncio.wait_for(self._arrived.wait(), max(self._learning_until - self._clock(), 0.0))
            except asyncio.TimeoutError:
                pass

    async def served(self, role: str, base_model: str) -> None:
        """Return once a ``role`` ("trainer" or "sampler") of ``base_model`` is here. A model that is
        expected is waited for up to worker_timeout_seconds (WorkersAbsent after that); an unknown one
        answers NotFound (at the latest when the learning window ends)."""
        deadline = self._clock() + self.settings.worker_timeout_seconds
        while not any(w.info.base_model == base_model for w in self._handles(role)):
            now = self._clock()
            if not self.expects(base_model) or now >= deadline:
                raise self.absent(role, base_model)
            wake = min(deadline, self._learning_until) if self.learning() else deadline  # look again when learning ends
            try:
                await asyncio.wait_for(self._arrived.wait(), max(wake - now, 0.0))
            except asyncio.TimeoutError:
                pass
