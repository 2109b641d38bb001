"""The gateway's HTTP application: the Tinker SDK's protocol under /api/v1, answered by calls to the
scheduler's public gRPC API. Routes live in routes_session.py, routes_training.py,
routes_sampling.py and routes_rest.py, OpenAI-compatible sampling under /v1 in routes_openai.py
(Anthropic's /v1/messages in routes_anthropic.py; errors under /v1 in those APIs' shapes);
this module holds what they share (``Gateway``) and the error handling. Routes the gateway does not
serve answer 404 with a message (never a hang, never a 5xx, which the SDK would resend for minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from temper.common.auth import looks_like_jwt
from temper.common.errors import TemperError
from temper.services.gateway.body_limit import JSON_LIMIT, PROTOBUF_LIMIT, BodyLimit
from temper.services.gateway.errors import (PARSE_ERRORS, GatewayError, error_body, failed_result, http_headers, http_status,
                                            invalid, request_error)
from temper.services.gateway.futures import Futures
from temper.services.gateway.upstream import Scheduler
from temper.services.models.images import DEFAULT_LIMITS, ImageLimits

log = logging.getLogger("temper.gateway")


@dataclass
class Result:
    """A verb's answer, rendered when retrieved: protobuf for the SDK that asks for it (``proto``),
    else JSON."""

    json: Callable[[], dict]
    proto: Callable[[], bytes] | None = None


@dataclass
class Gateway:
    scheduler: Scheduler
    futures: Futures
    long_poll_seconds: float = 25.0

    def submit(self, key: str | None, request_id: str, work: Callable[[], Awaitable[Any]], fingerprint: str = "",
               **extra) -> dict:
        """Start a verb behind a future; its failure becomes the future's error result. ``fingerprint``
        (``fingerprint(request)``) tells a resent submission from another request under the same id."""
        async def run():
            try:
                return await work()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure reaches the SDK as the future's error
                error = GatewayError.of(exc)
                if error.code == grpc.StatusCode.INTERNAL and not isinstance(exc, (GatewayError, grpc.aio.AioRpcError)):
                    log.exception("%s failed", request_id)
                return Result(json=lambda: failed_result(error))

        return {"request_id": self.futures.submit(key, request_id, run, fingerprint), **extra}


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def image_limits(request: Request) -> ImageLimits:
    """What one image may be in the chat routes' early checks (settings: TEMPER_GATEWAY_IMAGE_*)."""
    return getattr(request.app.state, "image_limits", DEFAULT_LIMITS)


# Temper's keys are "tml-" and 43 URL-safe characters, its JWTs (POST /api/v1/auth/token) up to ~700
# (a 128-character tenant named twice); any printable ASCII token up to this length is passed on (a
# scheduler with auth off takes any key). gRPC metadata holds nothing else, and one far longer
# overflows its header limit (8 KiB: RESOURCE_EXHAUSTED, which clients would resend).
MAX_KEY_CHARS = 1024
_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")


def api_key(request: Request) -> str:
    """The caller's key: ``X-API-Key`` as the SDK sends it, or ``Authorization: Bearer``. Only its
    form is checked here: the scheduler checks the key itself on every call. Routes read it before
    the body, so a call without a key is 401 whatever its body."""
    key = sent_credential(request)
    if not key:
        raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, "no API key: set TINKER_API_KEY (a Temper key, tml-...)")
    if not _KEY.fullmatch(key):
        raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, "the API key is not a Temper key (tml-... or a JWT from "
                                                            f"/api/v1/auth/token, printable ASCII, at most {MAX_KEY_CHARS} characters)")
    return key


def sent_credential(request: Request) -> str:
    """The key or token the request carries, unchecked ("" if none)."""
    key = request.headers.get("x-api-key")
    if not key:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else ""
    return key


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}", parse_constant=_not_json)  # Python's json would take NaN and Infinity
    except RecursionError:
        raise invalid("the body is not JSON the gateway reads: nested too deeply") from None
    except ValueError as exc:
        raise invalid(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


async def fingerprint(request: Request) -> str:
    """What makes a submission the same request: its route and its body (a resent one repeats both)."""
    digest = hashlib.sha256(request.url.path.encode())
    digest.update(await request.body())
    return digest.hexdigest()


OPENAI_PREFIXES = ("/v1", "/oai/api/v1")


def api_family(path: str) -> str:
    """Whose clients call ``path``: "anthropic" (/v1/messages), "openai" (the rest of /v1 and
    /oai/api/v1) or "tinker"; errors are answered in that family's shape."""
    for prefix in OPENAI_PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            rest = path[len(prefix):]
            return "anthropic" if rest == "/messages" or rest.startswith("/messages/") else "openai"
    return "tinker"


def error_response(error: GatewayError, path: str = "") -> JSONResponse:
    from temper.services.gateway import anthropic_convert, openai_convert

    family = api_family(path)
    if family == "anthropic":
        status, body = anthropic_convert.error_body(error)
    elif family == "openai":
        status, body = openai_convert.error_body(error)
    else:
        status, body = http_status(error), error_body(error)
    return JSONResponse(body, status_code=status, headers=http_headers(status))


def create_app(scheduler: Scheduler, long_poll_seconds: float = 25.0, future_keep_seconds: float = 3600.0,
               json_body_limit: int = JSON_LIMIT, protobuf_body_limit: int = PROTOBUF_LIMIT) -> FastAPI:
    from temper.services.gateway import (console, routes_anthropic, routes_openai, routes_rest, routes_sampling, routes_session,
                                         routes_training)

    state = Gateway(scheduler, Futures(future_keep_seconds), long_poll_seconds)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        sweeper = asyncio.create_task(state.futures.sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            state.futures.cancel_all()
            await scheduler.close()

    app = FastAPI(title="Temper gateway (Tinker SDK protocol)", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = state
    app.add_middleware(BodyLimit, json_limit=json_body_limit, protobuf_limit=protobuf_body_limit)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError):
        log.info("%s %s -> %s", request.method, request.url.path, exc)
        response = error_response(exc, request.url.path)
        if response.status_code == 401 and looks_like_jwt(sent_credential(request)):
            # RFC 6750: the token itself is refused (expired, tampered, its key revoked); the SDK then
            # exchanges its key for a new one and replays the request once
            response.headers["WWW-Authenticate"] = 'Bearer error="invalid_token"'
        return response

    @app.exception_handler(TemperError)  # raised by shared checks (parse_path, encode_tokens)
    async def _temper_error(request: Request, exc: TemperError):
        return await _gateway_error(request, GatewayError.of(exc))

    # The backstop for a body no typed read (fields.py) caught: a route handler reads the request,
    # makes scheduler calls (whose failures are GatewayErrors already) and renders the answer, so
    # these exceptions come from a malformed request in practice. 400 is the lesser harm: a 5xx makes
    # the SDK resend the same body for minutes. The traceback is logged (request_error), so a gateway
    # bug behind one stays visible. Verbs behind a future are handled in their own task
    # (Gateway.submit, routes_training._build).
    async def _malformed(request: Request, exc: Exception):
        return await _gateway_error(request, request_error(exc))

    for kind in PARSE_ERRORS:
        app.add_exception_handler(kind, _malformed)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(invalid(f"bad request: {exc.errors()}"), request.url.path)

    for module in (routes_session, routes_training, routes_sampling, routes_rest, routes_openai, routes_anthropic):
        app.include_router(module.router)
    from temper.services.gateway import routes_audit  # the SDK's AdminClient.get_audit_log (GET /api/v1/audit)
    app.include_router(routes_audit.router)
    from temper.services.gateway import routes_records  # sessions list/get, checkpoint storage usage, whoami
    app.include_router(routes_records.router)
    from temper.services.gateway import routes_projects  # projects, assign_session_project, search_sessions (issue 33)
    app.include_router(routes_projects.router)
    from temper.services.gateway import routes_images  # the caller's uploaded images (image_asset_pointer chunks)
    app.include_router(routes_images.router)
    from temper.services.gateway import routes_downloads  # signed URLs of external_weights checkpoints
    app.include_router(routes_downloads.router)
    from temper.services.gateway import routes_billing  # billing usage events, copy_weights, the cookbook's models.json
    app.include_router(routes_billing.router)
    console.install(app)  # the web console at /console (and /api/v1/sessions/{id}/trace)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def _not_served(path: str, request: Request):
        return error_response(GatewayError(grpc.StatusCode.UNIMPLEMENTED,
                                           f"{request.method} /{path} is not served by Temper's Tinker gateway"),
                              request.url.path)

    return app
