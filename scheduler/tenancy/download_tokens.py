"""Tokens of signed checkpoint downloads (external_weights URLs): made and checked by any scheduler
replica with the shared "download" signing key (scheduler/db/signing_keys.py).

A token is ``v1.<kid>.<expires_unix_ms>.<generation>.<reader>.<signature>``; the signature is
HMAC-SHA256, under the key ``kid``, over the key id, the checkpoint's path, the file's relative path,
the expiry, the checkpoint's generation (its creation time in ms) and the reader (the tenant the URLs
were signed for, base64url). So a token opens one file of one checkpoint until it expires; a
checkpoint deleted and saved again under the same name is not opened by the old checkpoint's tokens;
and the reader's right is checked again on every download (an unpublished checkpoint's URLs stop
opening for other tenants at once). Pure functions: the database is the caller's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import NamedTuple

from temper.common.errors import PermissionDenied
from temper.scheduler.db.signing_keys import SigningKey

PURPOSE = "download"
VERSION = "v1"
_REFUSED = "the download link is invalid or has expired: ask for new URLs (get_external_weights_urls)"


class TokenFields(NamedTuple):
    kid: str
    expires_unix_ms: int
    generation: int
    reader: str  # the tenant the token was signed for
    signature: str


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> str:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        raise PermissionDenied(_REFUSED) from None


def _signature(key: SigningKey, path: str, relative_path: str, expires_unix_ms: int, generation: int, reader: str) -> str:
    message = "\n".join((f"temper-download-{VERSION}", key.kid, path, relative_path, str(expires_unix_ms), str(generation),
                         reader))
    return _b64(hmac.new(key.secret, message.encode(), hashlib.sha256).digest())


def sign(key: SigningKey, path: str, relative_path: str, expires_unix_ms: int, generation: int, reader: str) -> str:
    return ".".join((VERSION, key.kid, str(expires_unix_ms), str(generation), _b64(reader.encode()),
                     _signature(key, path, relative_path, expires_unix_ms, generation, reader)))


def parse(token: str) -> TokenFields:
    """The token's fields; PermissionDenied if it is not a token at all."""
    parts = token.split(".")
    if len(parts) != 6 or parts[0] != VERSION or not all(parts) or not (parts[2].isdigit() and parts[3].isdigit()):
        raise PermissionDenied(_REFUSED)
    return TokenFields(parts[1], int(parts[2]), int(parts[3]), _unb64(parts[4]), parts[5])


def verify(key: SigningKey | None, fields: TokenFields, path: str, relative_path: str, now_unix_ms: int) -> None:
    """PermissionDenied unless ``fields`` were signed with ``key`` (None: unknown or retired) for this
    file and have not expired. Every refusal reads the same (no hint which part was wrong)."""
    if key is None or fields.expires_unix_ms <= now_unix_ms:
        raise PermissionDenied(_REFUSED)
    expected = _signature(key, path, relative_path, fields.expires_unix_ms, fields.generation, fields.reader)
    if not hmac.compare_digest(expected.encode(), fields.signature.encode()):
        raise PermissionDenied(_REFUSED)
