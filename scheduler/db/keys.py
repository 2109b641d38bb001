"""API keys: ``tml-`` + 256 random bits (the official tinker SDK accepts keys with that prefix).

Only a key's SHA-256 is stored; a fast hash is right for random keys (nothing to brute-force in a
dictionary), and it lets a lookup be one indexed equality. The first characters are kept too, so
people can tell their keys apart in listings and logs."""

from __future__ import annotations

import hashlib
import secrets

PREFIX = "tml-"
PREFIX_LENGTH = len(PREFIX) + 8  # "tml-" and 8 characters of the random part (48 bits: listing, never lookup)


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def prefix(key: str) -> str:
    return key[:PREFIX_LENGTH]
