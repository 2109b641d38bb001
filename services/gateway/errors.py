"""gRPC statuses of the scheduler -> what the Tinker SDK understands.

Two places an error reaches the SDK (tinker-wire-spec.md 4.4, 4.9):
- a synchronous route (create_session, get_info, REST): an HTTP status. The SDK retries 408, 409,
  429 and 5xx (with backoff, for minutes) and raises on the other 4xx with our message, so only
  transient statuses may map to a retried code.
- an asynchronous verb (forward_backward, sample, ...): the future's result is
  ``{"error", "category"}``, which the SDK raises as ``RequestFailedError`` without retrying. Transient
  statuses never get there: the gateway resends those itself (upstream.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from temper.common.errors import TemperError, is_hard_limit

log = logging.getLogger("temper.gateway")
MAX_MESSAGE_CHARS = 1000  # an error message echoes parts of the request: never the whole of a large one
# What reading a malformed body raises where no check named the field (int("x"), .get on a list, a
# protobuf field out of range, json nested too deeply): the request's fault, answered 400.
PARSE_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError)

# The statuses worth resending: the scheduler deduplicates a training run's (run, seq), and sampling
# calls change nothing when refused. A hard quota limit is RESOURCE_EXHAUSTED too but is final.
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 404,  # a 5xx would be retried for minutes; the SDK raises a 404 at once
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 503,
}
# Refusals caused by the request or the caller (the SDK counts them as user errors in its telemetry).
_USER = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED}


@dataclass
class GatewayError(Exception):
    """An error with the gRPC status it stands for; routes raise it, one handler answers it."""

    code: grpc.StatusCode
    message: str
    status: int | None = None  # an HTTP status no gRPC code stands for (413)

    def __str__(self) -> str:
        return f"{self.code.name}: {bounded(self.message)}"

    @classmethod
    def of(cls, exc: BaseException) -> "GatewayError":
        if isinstance(exc, GatewayError):
            return exc
        if isinstance(exc, grpc.aio.AioRpcError):
            return cls(exc.code(), exc.details() or exc.code().name)
        if isinstance(exc, TemperError):
            return cls(exc.code, exc.message)
        return cls(grpc.StatusCode.INTERNAL, f"gateway error ({type(exc).__name__}); see the gateway log")

    @property
    def hard_limit(self) -> bool:
        return is_hard_limit(self.code, self.message)

    @property
    def transient(self) -> bool:
        return self.code in TRANSIENT and not self.hard_limit


def invalid(message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message)


def too_large(limit: int) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"the request body is larger than {limit} bytes", status=413)


def request_error(exc: BaseException) -> GatewayError:
    """An exception raised while reading a request: a malformed request (INVALID_ARGUMENT) unless it
    carries a status of its own. Logged with its traceback, so a gateway bug behind it stays visible."""
    if isinstance(exc, (GatewayError, TemperError, grpc.aio.AioRpcError)):
        return GatewayError.of(exc)
    if isinstance(exc, PARSE_ERRORS):
        log.warning("malformed request (%s)", type(exc).__name__, exc_info=exc)
        return invalid(f"malformed request ({type(exc).__name__}): check the types of its fields")
    log.error("request failed", exc_info=exc)
    return GatewayError.of(exc)


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def http_status(error: GatewayError) -> int:
    """A hard quota limit is 403: 429 would be resent for minutes, and 402 would pause the SDK an hour."""
    if error.status is not None:
        return error.status
    if error.hard_limit:
        return 403
    return _HTTP.get(error.code, 500)


def http_headers(status: int) -> dict[str, str]:
    """``x-should-retry`` overrides the SDK's own rule (it resends 409, meant for lock timeouts)."""
    return {"x-should-retry": "true" if status in (408, 429) or status >= 500 else "false"}


def error_body(error: GatewayError) -> dict:
    """The JSON body of an HTTP error (the SDK shows it in the exception's message)."""
    return {"error": bounded(error.message), "code": error.code.name, "category": category(error)}


def category(error: GatewayError) -> str:
    return "user" if error.code in _USER or error.hard_limit else "server"


def failed_result(error: GatewayError) -> dict:
    """A future's result for a failed verb: the SDK raises RequestFailedError with this message."""
    return {"error": str(error), "category": category(error)}
