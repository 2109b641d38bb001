"""Calls to a worker that can be given up while they wait (``Calls.abandon``).

A frozen worker (SIGSTOP, a hung device) keeps its TCP connection open, so a call to it waits for
its whole deadline: minutes. Once the scheduler has moved a trainer's runs elsewhere
(``Recovery.fail_over``), every call still waiting there is given up at once and raises
``Abandoned`` in its caller, whatever the call was (cycle, snapshot, restore, save, load, create,
drop, import, read). What the trainer applies when it wakes is on a copy nobody uses again (recovery
drops it when it answers). A sampler marked down (no heartbeat: ``membership.py``) has its calls
(sample, logprobs, stream reads, adapter pushes and drops) given up the same way, and sampling
routing takes the request to another sampler. One mechanism on the worker's handle, so no call site
has its own.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from temper.common.errors import Abandoned

T = TypeVar("T")


class Calls:
    """The calls awaited on one worker now."""

    def __init__(self, what: str, outcome: str = "its runs moved to another trainer"):
        self.what, self.outcome = what, outcome
        self._waiting: set[asyncio.Future] = set()
        self._given_up: set[asyncio.Future] = set()

    async def run(self, call: Awaitable[T]) -> T:
        """``call``'s answer, unless abandon() is called meanwhile (Abandoned)."""
        task = asyncio.ensure_future(call)
        self._waiting.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            # given up by abandon(), not the caller itself being cancelled (a lane stopping)
            if task in self._given_up and not asyncio.current_task().cancelling():
                raise Abandoned(f"{self.what} stopped answering and {self.outcome}: this call was given up") from None
            raise
        finally:
            self._waiting.discard(task)
            self._given_up.discard(task)

    def abandon(self) -> int:
        """Give up every call waiting now (calls made later are not affected); how many."""
        waiting = [task for task in self._waiting if not task.done()]
        for task in waiting:
            self._given_up.add(task)
            task.cancel()
        return len(waiting)

    def __len__(self) -> int:
        return sum(1 for task in self._waiting if not task.done())
