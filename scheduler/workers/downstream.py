"""Calls from the scheduler to its trainers and samplers: a failed call becomes the matching domain
error; no answer in time, or no connection, becomes Unavailable (the outcome is not known)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import grpc

from temper.common.errors import Unavailable, from_rpc_error

# A worker that does not answer in time, or cannot be reached: the call's outcome is unknown.
UNKNOWN_OUTCOME_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@asynccontextmanager
async def downstream(what: str, unavailable: type[Unavailable] = Unavailable):
    """Turn a failed call to a trainer or sampler into the matching domain error; no answer in time
    or no connection becomes ``unavailable`` (retryable: the outcome is not known)."""
    try:
        yield
    except grpc.aio.AioRpcError as err:
        exc = from_rpc_error(err)
        if err.code() in UNKNOWN_OUTCOME_CODES:
            exc = unavailable(f"{what} did not answer ({err.code().name}): {err.details()}")
        raise exc from None
