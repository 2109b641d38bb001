"""Domain errors and their gRPC status codes.

Servers raise these; one interceptor (``ErrorInterceptor``) turns them into status codes, so no
servicer builds error payloads. Clients turn a failed RPC back into ``TemperError`` subclasses with
``from_rpc_error``. Nothing here imports torch.
"""

from __future__ import annotations

import inspect
import logging
from typing import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)
# Every status message a server sends is cut to this (``_abort``): a backstop for a message that
# would echo a large input.
MAX_STATUS_CHARS = 1024


def shown(value: str, limit: int = 64) -> str:
    """``value`` for an error message: repr'd and cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'" + f" ({len(value)} chars)"


def bounded(message: str, limit: int = MAX_STATUS_CHARS) -> str:
    """``message`` cut to ``limit`` characters (its start kept: codes and prefixes such as
    ``AdapterNotLoaded.PREFIX`` are read from there)."""
    return message if len(message) <= limit else message[: limit - 24] + f"... ({len(message)} chars)"


class TemperError(Exception):
    """Base of all errors with a well-defined gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(TemperError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TemperError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TemperError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(TemperError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AdapterNotLoaded(FailedPrecondition):
    """A sampler does not hold the adapter a call names (evicted, never pushed, or the sampler
    restarted): the caller pushes it again. On the wire: FAILED_PRECONDITION whose details start
    with ``PREFIX`` (``matches`` recognises it after ``from_rpc_error``)."""

    PREFIX = "ADAPTER_NOT_LOADED: "

    def __init__(self, checkpoint_key: str):
        super().__init__(f"{self.PREFIX}checkpoint {checkpoint_key} is not loaded on this sampler")
        self.checkpoint_key = checkpoint_key

    @classmethod
    def matches(cls, exc: BaseException) -> bool:
        return (isinstance(exc, TemperError) and exc.code == grpc.StatusCode.FAILED_PRECONDITION
                and exc.message.startswith(cls.PREFIX))


class ResourceExhausted(TemperError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


# A RESOURCE_EXHAUSTED whose details start with this is a tenant's hard limit (runs, storage): waiting
# does not help, so clients raise it at once; any other RESOURCE_EXHAUSTED is backpressure to retry.
HARD_LIMIT_PREFIX = "limit "


def is_hard_limit(code: grpc.StatusCode, details: str | None) -> bool:
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and (details or "").startswith(HARD_LIMIT_PREFIX)


class Unavailable(TemperError):
    code = grpc.StatusCode.UNAVAILABLE


class Abandoned(TemperError):
    """A call to a worker given up because the worker stopped answering and its runs moved to another
    (scheduler/workers/abandon.py). UNAVAILABLE on the wire; not an Unavailable, so that no retry loop
    resends it to the same worker: the caller holds the work for the run's new trainer instead."""
    code = grpc.StatusCode.UNAVAILABLE


class LeaseLost(TemperError):
    """This scheduler replica no longer holds the lease of a trainer's lane (scheduler/cluster/): it
    expired, or another replica took it with a newer fencing token. Raised before any of the lane's
    rows are written, so the caller's transaction rolls back and the verb was not applied.

    UNAVAILABLE on the wire, not FAILED_PRECONDITION: nothing is wrong with the request, only with
    where it landed; the client's retry, through any replica, reaches the lane's new owner and gets
    the true outcome from the (run, seq) log, as after a restart (clients raise FAILED_PRECONDITION
    at once). Not an Unavailable, like Abandoned, so no in-process retry loop resends it here: this
    replica will never hold that token again."""
    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, lane: str, token: int, why: str):
        super().__init__(f"lease of lane {lane!r} lost (token {token}): {why}; retry through any replica")
        self.lane = lane
        self.token = token


class Unauthenticated(TemperError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TemperError):
    """A valid key that may not do this (an operator's call with a tenant's key)."""
    code = grpc.StatusCode.PERMISSION_DENIED


class Internal(TemperError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, ResourceExhausted, Unavailable,
                                      Unauthenticated, PermissionDenied)}

# Who may call: awaited with (method, context) before every handler; raises Unauthenticated to refuse.
Authenticator = Callable[[str, grpc.aio.ServicerContext], Awaitable[None]]
# Told of every failed call: (full method name, the status code sent). common/metrics.count_rpc_error.
ErrorCounter = Callable[[str, grpc.StatusCode], None]


def from_rpc_error(err: grpc.RpcError) -> TemperError:
    """Map a failed call (from a client stub or a downstream service) back to a domain error."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return _error(code, details)


def status_number(exc: TemperError) -> int:
    """The error's gRPC status code as a number (for a status carried inside a message)."""
    return exc.code.value[0]


def from_status_number(number: int, message: str) -> TemperError:
    """The domain error of a status carried inside a message (``status_number``'s inverse)."""
    code = next((c for c in grpc.StatusCode if c.value[0] == number), grpc.StatusCode.UNKNOWN)
    return _error(code, message)


def _error(code: grpc.StatusCode, details: str | None) -> TemperError:
    exc = _BY_CODE.get(code, Internal)(details or code.name)
    exc.code = code
    return exc


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by servicers to status codes: TemperError → its code, else INTERNAL.
    An ``authenticate`` hook runs first inside the same mapping (and the same task, so a context
    variable it sets is seen by the handler). ``count`` is told of each failed call, so every
    service's errors are counted here, the same way, and by no servicer."""

    def __init__(self, authenticate: Authenticator | None = None, count: ErrorCounter | None = None):
        self.authenticate = authenticate
        self.count = count
        self._wrapped: dict[str, tuple[object, object]] = {}  # method -> (its handler, wrapped): built once, not per call

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior:
                wrapped = handler._replace(**{kind: _wrap(behavior, method, self.authenticate, self.count)})
                break
        self._wrapped[method] = (handler, wrapped)
        return wrapped


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str, count: ErrorCounter | None):
    if count is not None:
        count(method, exc.code if isinstance(exc, TemperError) else grpc.StatusCode.INTERNAL)
    if isinstance(exc, TemperError):
        message = bounded(exc.message)
        log.info("%s -> %s: %s", method, exc.code.name, message)
        await context.abort(exc.code, message)
    log.exception("%s failed", method, exc_info=exc)
    # The details stay in this server's log: an exception's text can carry SQL, paths or the caller's input.
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}) in {method}; see the server log")


_STRING_FIELDS: dict[type, tuple[str, ...] | None] = {}  # request type -> the fields checked here (None: all)


def _check_strings(request) -> None:
    """Every unary request's strings are checked before a servicer sees them (common/strings.py)."""
    kind = type(request)
    if kind not in _STRING_FIELDS:
        from google.protobuf.message import Message

        if not isinstance(request, Message):
            return  # a stream's request iterator: its messages are the servicer's to check
        # A sequenced request (it carries a seq_id) is checked whole by admission, where a rejection
        # spends its seq; refused here, it would leave a gap its run waits on.
        _STRING_FIELDS[kind] = ("training_run_id",) if "seq_id" in request.DESCRIPTOR.fields_by_name else None
    from temper.common.strings import check_request_strings

    check_request_strings(request, only=_STRING_FIELDS[kind])


async def _admit(request, context, method: str, authenticate: Authenticator | None) -> None:
    if authenticate is not None:
        await authenticate(method, context)
    _check_strings(request)


def _wrap(behavior, method, authenticate: Authenticator | None = None, count: ErrorCounter | None = None):
    """Wrap a handler in one of the same kind: grpc.aio sends an async generator's items itself,
    while a coroutine handler returns its reply or streams with ``context.write`` (grpc_health's
    Watch does), so wrapping a coroutine in a generator breaks it."""
    if inspect.isasyncgenfunction(behavior):
        async def stream_wrapper(request, context):
            try:
                await _admit(request, context, method, authenticate)
                async for item in behavior(request, context):
                    yield item
            except (grpc.aio.AbortError, grpc.aio.UsageError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the one place exceptions become statuses
                await _abort(context, exc, method, count)

        return stream_wrapper

    async def wrapper(request, context):
        try:
            await _admit(request, context, method, authenticate)
            return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, method, count)

    return wrapper
