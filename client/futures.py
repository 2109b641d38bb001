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


def completed(value: T) -> APIFuture[T]:
    """An APIFuture that is already done (for calls answered without the server)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return APIFuture(future)


class ClientFuture(APIFuture[T]):
    """What the creation calls return, as the Tinker SDK's back-compat futures do: a future of the
    client (``.result()``, ``await``) that can also be used as the client itself. Creation goes on in
    the background; the first use of an attribute waits for it (and raises its error, if any)."""

    def __getattr__(self, name: str):
        # Only names the future lacks get here (result, done, ... are its own).
        if name.startswith("__") or name in ("_future", "_transform"):
            raise AttributeError(name)
        return getattr(self.result(), name)

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        elif self._future.exception() is not None:
            state = f"failed: {self._future.exception()!r}"
        else:
            state = repr(self._future.result())
        return f"<{type(self).__name__}: {state}>"
