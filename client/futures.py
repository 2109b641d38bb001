"""APIFuture: what every client verb returns at once. ``.result()`` blocks, ``await fut`` and
``await fut.result_async()`` wait in asyncio code."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    def __init__(self, future: concurrent.futures.Future, transform: Callable[[Any], T] | None = None):
        self._future = future
        self._transform = transform or (lambda x: x)

    def result(self, timeout: float | None = None) -> T:
        return self._transform(self._future.result(timeout))

    async def result_async(self, timeout: float | None = None) -> T:
        value = await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)
        return self._transform(value)

    def __await__(self):
        return self.result_async().__await__()

    def done(self) -> bool:
        return self._future.done()

    def future(self) -> concurrent.futures.Future:
        return self._future
