"""The errors temper.client raises, catchable by the names Tinker users write.

Each failed call raises one class that is both the Tinker SDK's exception for that failure
(``tinker.BadRequestError`` for a 400, ...) and Temper's domain error for the gRPC status
(``InvalidArgument``, ...), so ``except BadRequestError`` and ``except InvalidArgument`` both work.
Over gRPC there is no HTTP status: ``status_code`` is the one the gateway answers for that status
(services/gateway/errors.py), and every status error is also a ``RequestFailedError`` (the SDK's
error for a request that failed on the server; ``category`` "user" or "server").
"""

from __future__ import annotations

import grpc

from temper.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TemperError,
    Unauthenticated,
    Unavailable,
)


class TinkerError(TemperError):
    """Base of every error the client raises for the server (tinker.TinkerError)."""


class APIError(TinkerError):
    body: object | None = None


class RequestFailedError(TinkerError):
    category: str = "server"  # tinker.types.RequestErrorCategory's values: "user" | "server" | "unknown"
    request_id: str = ""


class APIStatusError(APIError, RequestFailedError):
    """The server refused or failed a call (tinker.APIStatusError)."""

    status_code: int = 500
    response = None  # no HTTP response over gRPC


class APIResponseValidationError(APIError):
    """The server's answer did not have the expected shape (tinker's name; gRPC messages are typed)."""


class APIConnectionError(APIError, Unavailable):
    """The scheduler cannot be reached (wrong or dead address, network)."""


class APITimeoutError(APIConnectionError):
    """The call's deadline passed (the ``timeout`` of ServiceClient)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class BadRequestError(APIStatusError):
    status_code, category, code = 400, "user", grpc.StatusCode.INVALID_ARGUMENT


class InvalidArgumentError(BadRequestError, InvalidArgument):
    """The request is invalid (INVALID_ARGUMENT, OUT_OF_RANGE)."""


class FailedPreconditionError(BadRequestError, FailedPrecondition):
    """A request the server's state refuses (the gateway answers 400 for it too)."""


class AuthenticationError(APIStatusError, Unauthenticated):
    status_code, category = 401, "user"


class BillingError(APIStatusError):
    """tinker's 402; Temper has no billing, its quota limits are RateLimitError."""

    status_code, category = 402, "user"


class PermissionDeniedError(APIStatusError):
    status_code, category, code = 403, "user", grpc.StatusCode.PERMISSION_DENIED


class NotFoundError(APIStatusError, NotFound):
    status_code, category = 404, "user"


class ConflictError(APIStatusError, AlreadyExists):
    status_code, category = 409, "user"


class UnprocessableEntityError(BadRequestError):
    status_code = 422


class RateLimitError(APIStatusError, ResourceExhausted):
    """Backpressure the client gave up waiting on, or a hard quota limit (``limit ...``)."""

    status_code, category = 429, "user"


class InternalServerError(APIStatusError, Internal):
    status_code = 500


class ServiceUnavailableError(InternalServerError, Unavailable):
    """UNAVAILABLE after the client's retries (the SDK calls every 5xx InternalServerError)."""

    status_code = 503


class UnsupportedError(APIStatusError, NotImplementedError):
    """A part of the Tinker API that Temper does not serve (yet); the message names it."""

    status_code, category, code = 501, "user", grpc.StatusCode.UNIMPLEMENTED


_BY_CODE: dict[grpc.StatusCode, type[TinkerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: ConflictError,
    grpc.StatusCode.ABORTED: ConflictError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: APITimeoutError,
    grpc.StatusCode.UNIMPLEMENTED: UnsupportedError,
}


def error_for(code: grpc.StatusCode, details: str | None) -> TinkerError:
    exc = _BY_CODE.get(code, InternalServerError)(details or code.name)
    exc.code = code
    return exc


def from_rpc_error(err: grpc.RpcError) -> TinkerError:
    """A failed call as the client raises it."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    return error_for(code, err.details() if hasattr(err, "details") else str(err))


def unsupported(what: str, hint: str = "") -> UnsupportedError:
    return UnsupportedError(f"{what} is not supported by Temper" + (f": {hint}" if hint else ""))


__all__ = [
    "APIConnectionError", "APIError", "APIResponseValidationError", "APIStatusError", "APITimeoutError",
    "AuthenticationError", "BadRequestError", "BillingError", "ConflictError", "FailedPreconditionError",
    "InternalServerError", "InvalidArgumentError", "NotFoundError", "PermissionDeniedError", "RateLimitError",
    "RequestFailedError", "ServiceUnavailableError", "TinkerError", "UnprocessableEntityError", "UnsupportedError",
    "error_for", "from_rpc_error", "unsupported",
]
