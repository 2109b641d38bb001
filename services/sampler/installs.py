"""Adapter installs waiting for the compute thread. A push queues its install here and asks the compute
thread to run the queue; a batch that is decoding runs it too, between two decode steps (decode_steps
calls ``run(busy)`` through ``SampleRequest.between_steps``), so an in-flight update never waits for a
whole batch. Whichever comes first runs a job (each exactly once); both are on the one compute thread,
so a load never interleaves with a forward.

Between steps, an install that would touch an adapter the running batch decodes with (replacing that
key, or evicting it to make room) is left for after the batch: its rows keep their weights throughout."""

from __future__ import annotations

import collections
import contextlib
import shutil
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


class Busy(Exception):
    """Raised by the install function: this install needs an adapter the running batch uses; retry after it."""


@dataclass
class Job:
    key: str
    folder: Path
    size: int
    done: Future = field(default_factory=Future)
    checked: bool = False  # the backend accepted its files (a job that waits for a batch is not read again)


class PendingInstalls:
    def __init__(self, install: Callable[[Job, frozenset | None], None]):
        """``install(job, busy)``: check, make room and load; ``busy`` as in ``run`` (raises Busy to wait
        for the batch)."""
        self._install = install
        self._jobs: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()

    def submit(self, key: str, folder: Path, size: int) -> Job:
        job = Job(key, folder, size)
        with self._lock:
            self._jobs.append(job)
        return job

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def run(self, busy: frozenset | None = None) -> None:
        """Run the queued installs, in order (on the compute thread). ``busy``: between two decode steps,
        the adapters the batch decodes with (None: no batch is running); an install that needs one of
        them stays queued, and so does every later job for its key (pushes of one key land in order).
        A job's staged folder is removed once it ran (or its push gave up)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), collections.deque()
        waiting = []
        for job in jobs:
            if job.done.cancelled():  # its push gave up before it ran
                shutil.rmtree(job.folder, ignore_errors=True)
                continue
            if any(w.key == job.key for w in waiting):  # a later push of a waiting key lands after it
                waiting.append(job)
                continue
            try:
                self._install(job, busy)
            except Busy:
                waiting.append(job)
                continue
            except BaseException as exc:  # noqa: BLE001 - the push that queued it answers with it
                _settle(job.done, exc)
            else:
                _settle(job.done, None)
            shutil.rmtree(job.folder, ignore_errors=True)  # the weights are in memory now (or refused)
        if waiting:
            with self._lock:
                self._jobs.extendleft(reversed(waiting))


def _settle(done: Future, failure: BaseException | None) -> None:
    """Answer the push (unless it gave up meanwhile: then nobody reads the answer)."""
    with contextlib.suppress(InvalidStateError):
        if failure is None:
            done.set_result(None)
        else:
            done.set_exception(failure)
