"""Bearer credentials on gRPC calls: reading them on the server, the methods open without one."""

from __future__ import annotations

import grpc

AUTHORIZATION = "authorization"
# Probes and tooling reach these without credentials (they reveal no tenant's data).
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                         "/grpc.reflection.v1.ServerReflection/")


def is_open_method(method: str) -> bool:
    return method.startswith(OPEN_SERVICE_PREFIXES)


def bearer_token(context: grpc.aio.ServicerContext) -> str | None:
    """The token of the call's ``authorization: Bearer <token>`` metadata, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION:
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def bearer_metadata(token: str) -> tuple[str, str]:
    return (AUTHORIZATION, f"Bearer {token}")


def looks_like_jwt(credential: str) -> bool:
    """A compact JWS (three base64url parts; a JSON header starts "eyJ"): a token from the key-for-token
    exchange (scheduler/tenancy/jwt_tokens.py), never an API key ("tml-...")."""
    return credential.startswith("eyJ") and credential.count(".") == 2
