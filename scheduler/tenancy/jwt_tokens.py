"""Short-lived JWTs in place of an API key: the Tinker SDK's default auth (its ``/api/v1/auth/token``
exchange, served by the gateway through the scheduler's CreateAuthToken).

A token is HS256-signed with the current "jwt" signing key (scheduler/db/signing_keys.py, shared by
every replica; its ``kid`` is in the header) and carries who it speaks for: the tenant, the API key's
id and prefix, and the claims the SDK's ``RestClient.whoami`` reads (``sub``, ``org_id``, ``email``).
Verifying one checks signature, issuer and expiry here; ``ApiKeyAuth`` (auth.py) then requires the
key it names to be live, so revoking the key ends its tokens within ``key_cache_seconds``.

Signing keys are cached in memory: after a key's first use a check costs no database query.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import jwt

from temper.common.auth import looks_like_jwt  # noqa: F401 - re-exported for auth.py
from temper.common.errors import Unauthenticated
from temper.scheduler.db.signing_keys import SigningKey
from temper.scheduler.db.tenancy import KeyIdentity

PURPOSE = "jwt"
ALGORITHM = "HS256"
ISSUER = "temper"
LEEWAY_SECONDS = 5.0  # clocks of replicas (and of the database) differ a little
UNKNOWN_KID_SECONDS = 1.0  # an unknown kid is remembered briefly: forged headers cost no database queries
MAX_CACHED_KIDS = 256
REQUIRED_CLAIMS = ("iss", "sub", "iat", "exp", "org_id", "tenant", "key_id", "key_prefix")


class InvalidToken(Unauthenticated):
    """A token that is malformed, tampered with, expired, or signed with a key no longer accepted:
    the gateway answers it 401 with ``WWW-Authenticate: Bearer error="invalid_token"``."""


@dataclass(frozen=True)
class TokenClaims:
    tenant: str
    key_id: int
    key_prefix: str
    expires_unix: float


def make_token(key: SigningKey, identity: KeyIdentity, lifetime_seconds: float, now: float | None = None) -> str:
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": ISSUER,
        "sub": f"temper:api_key:{identity.prefix}",  # the SDK's whoami: user_urn
        "org_id": identity.tenant,                     # whoami: org_urn = tml:organization:<tenant>
        "email": "",                                   # no user behind a key: whoami reports None
        "tenant": identity.tenant,
        "key_id": identity.key_id,
        "key_prefix": identity.prefix,
        "iat": issued,
        "exp": issued + int(lifetime_seconds),
        "jti": secrets.token_hex(8),                   # two tokens of one second still differ
    }
    return jwt.encode(claims, key.secret, algorithm=ALGORITHM, headers={"kid": key.kid})


def token_kid(token: str) -> str:
    """The signing key a token names (unverified: only used to pick the key to verify with)."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.InvalidTokenError as exc:
        raise InvalidToken(f"malformed token ({exc}); exchange the API key for a new one") from None
    kid = header.get("kid")
    if header.get("alg") != ALGORITHM or not isinstance(kid, str) or not kid:
        raise InvalidToken(f"not a Temper token (its header must name alg {ALGORITHM} and a kid)")
    return kid


def read_token(token: str, key: SigningKey | None) -> TokenClaims:
    """The claims of a token signed with ``key`` (None: its kid is unknown or retired); InvalidToken otherwise."""
    if key is None:
        raise InvalidToken("the token's signing key is unknown or retired; exchange the API key for a new token")
    try:
        claims = jwt.decode(token, key.secret, algorithms=[ALGORITHM], issuer=ISSUER, leeway=LEEWAY_SECONDS,
                            options={"require": list(REQUIRED_CLAIMS)})
    except jwt.ExpiredSignatureError:
        raise InvalidToken("the token expired; exchange the API key for a new one") from None
    except jwt.InvalidTokenError as exc:
        raise InvalidToken(f"the token was refused ({exc})") from None
    key_id, tenant, prefix = claims["key_id"], claims["tenant"], claims["key_prefix"]
    if not isinstance(key_id, int) or not isinstance(tenant, str) or not tenant or not isinstance(prefix, str):
        raise InvalidToken("the token's claims are malformed")
    return TokenClaims(tenant=tenant, key_id=key_id, key_prefix=prefix, expires_unix=float(claims["exp"]))


class JwtKeys:
    """The scheduler's side of tokens: signs new ones with the current key and verifies presented
    ones, with every signing key cached in memory (one database read per key per process)."""

    def __init__(self, store, lifetime_seconds: float = 900.0, rotate_after_seconds: float = 86400.0):
        self.store = store
        self.lifetime_seconds = lifetime_seconds
        self.rotate_after_seconds = rotate_after_seconds
        # a key signs for rotate_after_seconds; what it signed last lives lifetime_seconds more
        self.max_key_age_seconds = rotate_after_seconds + lifetime_seconds + LEEWAY_SECONDS
        self._current: SigningKey | None = None
        self._by_kid: dict[str, tuple[float, SigningKey | None]] = {}  # kid -> (until, key or None: unknown)

    async def issue(self, identity: KeyIdentity) -> tuple[str, float]:
        """A new token for ``identity`` and when it expires (Unix seconds)."""
        current = self._current
        if current is None or time.time() - current.created_unix >= self.rotate_after_seconds:
            current = self._current = await asyncio.to_thread(self.store.current_signing_key, PURPOSE,
                                                              self.rotate_after_seconds)
            self._by_kid[current.kid] = (float("inf"), current)
        now = time.time()
        return make_token(current, identity, self.lifetime_seconds, now), float(int(now) + int(self.lifetime_seconds))

    async def verify(self, token: str) -> TokenClaims:
        return read_token(token, await self._key(token_kid(token)))

    async def _key(self, kid: str) -> SigningKey | None:
        cached = self._by_kid.get(kid)
        if cached is None or cached[0] < time.monotonic():
            found = await asyncio.to_thread(self.store.signing_key, PURPOSE, kid, self.max_key_age_seconds)
            if len(self._by_kid) >= MAX_CACHED_KIDS:
                self._by_kid = {k: v for k, v in self._by_kid.items() if v[1] is not None}  # forged kids go first
                if len(self._by_kid) >= MAX_CACHED_KIDS:
                    self._by_kid.clear()
            cached = (float("inf") if found is not None else time.monotonic() + UNKNOWN_KID_SECONDS, found)
            self._by_kid[kid] = cached
        key = cached[1]
        if key is not None and time.time() - key.created_unix > self.max_key_age_seconds:
            return None  # retired: nothing it signed can still be valid
        return key
