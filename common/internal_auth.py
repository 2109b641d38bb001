"""The credential between the scheduler and its workers: one shared secret (``internal_token``) the
scheduler sends as ``authorization: Bearer <token>`` on every call to a trainer or sampler, and the
workers check before every handler (health and reflection stay open for probes).

A worker without a token refuses to start unless ``internal_auth=disabled`` says, explicitly, that
the network alone decides who reaches it."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from temper.common.auth import bearer_metadata, bearer_token, is_open_method
from temper.common.errors import Authenticator, Unauthenticated


class InternalAuthConfigError(RuntimeError):
    """The settings do not give a usable internal token; the message says how to set one."""


def resolve_token(settings, prefix: str) -> str | None:
    """The token from ``<prefix>INTERNAL_TOKEN`` or the file ``<prefix>INTERNAL_TOKEN_FILE`` names
    (surrounding whitespace dropped), or None when neither is set."""
    value = settings.internal_token.get_secret_value().strip() if settings.internal_token is not None else None
    path: Path | None = settings.internal_token_file
    if value and path is not None:
        raise InternalAuthConfigError(f"set one of {prefix}INTERNAL_TOKEN and {prefix}INTERNAL_TOKEN_FILE, not both")
    if path is not None:
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise InternalAuthConfigError(f"{prefix}INTERNAL_TOKEN_FILE: cannot read {path}: {exc.strerror}") from None
        if not value:
            raise InternalAuthConfigError(f"{prefix}INTERNAL_TOKEN_FILE: {path} is empty")
    return value or None


def token_authenticator(token: str) -> Authenticator:
    """Admit calls that carry ``token`` (compared in constant time); health and reflection are open."""
    expected = token.encode()

    async def authenticate(method: str, context: grpc.aio.ServicerContext) -> None:
        if is_open_method(method):
            return
        presented = bearer_token(context)
        if presented is None:
            raise Unauthenticated("this service answers the Temper scheduler only: the call carries no internal token")
        if not hmac.compare_digest(presented.encode(), expected):
            raise Unauthenticated("this service answers the Temper scheduler only: wrong internal token")

    return authenticate


def worker_authenticator(settings, prefix: str) -> Authenticator | None:
    """The authenticator of a trainer or sampler (ModelServiceSettings read under ``prefix``), or None
    when ``internal_auth`` is disabled. Raises InternalAuthConfigError when no token is configured."""
    token = resolve_token(settings, prefix)
    if settings.internal_auth == "disabled":
        return None
    if token is None:
        raise InternalAuthConfigError(
            f"no internal token: set {prefix}INTERNAL_TOKEN (or {prefix}INTERNAL_TOKEN_FILE) to the secret the "
            f"scheduler sends (TEMPER_SCHEDULER_INTERNAL_TOKEN), e.g. one from "
            f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`; or, to let anyone who reaches this port "
            f"call it, set {prefix}INTERNAL_AUTH=disabled")
    return token_authenticator(token)


class _Bearer:
    def __init__(self, token: str):
        self._pair = bearer_metadata(token)

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        pairs = [pair for pair in (details.metadata or ()) if pair[0] != self._pair[0]]
        return details._replace(metadata=grpc.aio.Metadata(*pairs, self._pair))


class _UnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


def bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send ``authorization: Bearer <token>`` on every call of a grpc.aio
    channel, of each of the four kinds (a channel files an interceptor under one kind only)."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
