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


class _WithToken:
    """A multicallable that sends the token with every call it makes; the call object is gRPC's own."""

    __slots__ = ("_call", "_pair")

    def __init__(self, multicallable, pair: tuple[str, str]):
        self._call = multicallable
        self._pair = pair

    def __call__(self, request, *, metadata=None, **kwargs):
        pairs = [pair for pair in (metadata or ()) if pair[0] != self._pair[0]]
        return self._call(request, metadata=(*pairs, self._pair), **kwargs)


class BearerChannel:
    """A grpc.aio channel whose calls, of all four kinds, carry ``authorization: Bearer <token>``.
    Stubs are built on it as on any channel. It adds the metadata as the call is made, rather than
    through client interceptors: an intercepted grpc.aio call runs as an extra task, which was 3 %
    of the scheduler's CPU on its calls to trainers (benchmarks/README.md, scaleout)."""

    def __init__(self, channel: grpc.aio.Channel, token: str):
        self._channel = channel
        self._pair = bearer_metadata(token)

    def unary_unary(self, *args, **kwargs):
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._pair)

    def unary_stream(self, *args, **kwargs):
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._pair)

    def stream_unary(self, *args, **kwargs):
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._pair)

    def stream_stream(self, *args, **kwargs):
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._pair)

    def __getattr__(self, name):  # close, channel_ready, get_state, wait_for_state_change
        return getattr(self._channel, name)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self._channel.close()


def with_token(channel: grpc.aio.Channel, token: str | None):
    """``channel`` sending ``token`` on every call; ``channel`` itself when there is no token."""
    return BearerChannel(channel, token) if token else channel
