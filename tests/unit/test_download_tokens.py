"""Signed download tokens (scheduler/tenancy/download_tokens.py) and their keys (DownloadVerbs on the
shared "download" signing key): a token opens one file of one checkpoint generation until it
expires; a tampered, re-targeted or expired token is refused alike; a key rotated out still verifies
what it signed until it is retired (rotation period + URL lifetime)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import update
from sqlalchemy.orm import sessionmaker

from temper.common.errors import PermissionDenied
from temper.scheduler.api.download_verbs import DownloadVerbs
from temper.scheduler.db import models as m
from temper.scheduler.db.signing_keys import SigningKey
from temper.scheduler.db.store import make_engine, upgrade_schema
from temper.scheduler.tenancy import download_tokens as tokens

KEY = SigningKey(kid="k1", secret=b"s" * 32, purpose="download", created_unix=0.0)
READER = "tenant.with-dots"
PATH, FILE, GEN, EXPIRES = "tinker://s:train:0/external_weights/out", "adapter_model.safetensors", 1_700_000_000_123, 2_000_000_000_000


def check(token: str, key=KEY, path=PATH, relative_path=FILE, now=EXPIRES - 1):
    tokens.verify(key, tokens.parse(token), path, relative_path, now)


def fields_b64(token: str) -> str:
    return token.split(".")[4]


def test_a_token_opens_its_file_until_it_expires_and_nothing_else():
    token = tokens.sign(KEY, PATH, FILE, EXPIRES, GEN, READER)
    check(token)
    fields = tokens.parse(token)
    assert (fields.kid, fields.expires_unix_ms, fields.generation, fields.reader) == ("k1", EXPIRES, GEN, READER)
    other_reader = tokens.sign(KEY, PATH, FILE, EXPIRES, GEN, "other").split(".")[4]
    last = token[-1]
    refused = {
        "tampered signature": dict(token=token[:-1] + ("A" if last != "A" else "B")),
        "another file": dict(token=token, relative_path="adapter_config.json"),
        "another checkpoint": dict(token=token, path=PATH + "2"),
        "expiry moved": dict(token=token.replace(f".{EXPIRES}.", f".{EXPIRES + 1000}.")),
        "generation changed": dict(token=token.replace(f".{GEN}.", f".{GEN + 1}.")),
        "reader changed": dict(token=token.replace(f".{fields_b64(token)}.", f".{other_reader}.")),
        "expired": dict(token=token, now=EXPIRES),
        "unknown or retired key": dict(token=token, key=None),
        "same kid, other secret": dict(token=token, key=SigningKey("k1", b"t" * 32, "download", 0.0)),
    }
    for why, kwargs in refused.items():
        with pytest.raises(PermissionDenied) as refusal:
            check(**kwargs)
        assert "invalid or has expired" in refusal.value.message, why
    for malformed in ("", "v1", "v2" + token[2:], token + ".x", token.replace(f".{EXPIRES}.", ".soon."), "v1....."):
        with pytest.raises(PermissionDenied):
            tokens.parse(malformed)


@pytest.fixture
def verbs(tmp_path):
    """DownloadVerbs' key handling on a migrated SQLite database (rotation 1 h, URLs valid 10 min)."""
    url = f"sqlite:///{tmp_path / 'download.db'}"
    upgrade_schema(url)
    engine = make_engine(url)
    holder = DownloadVerbs()
    holder.store = SimpleNamespace(sessions=sessionmaker(engine, expire_on_commit=False))
    holder.admission = SimpleNamespace(settings=SimpleNamespace(download_key_rotate_seconds=3600.0, download_url_seconds=600.0))
    yield holder
    engine.dispose()


def make_older(holder, kid: str, seconds: float) -> None:
    with holder.store.sessions.begin() as db:
        created = db.get(m.SigningKey, kid).created_at
        db.execute(update(m.SigningKey).where(m.SigningKey.kid == kid).values(created_at=created - timedelta(seconds=seconds)))


def test_a_rotated_key_still_verifies_what_it_signed_until_it_is_retired(verbs):
    first = verbs._signing_key()
    assert verbs._signing_key() == first  # kept while younger than the rotation period
    token = tokens.sign(first, PATH, FILE, EXPIRES, GEN, READER)
    make_older(verbs, first.kid, 3601)  # past rotation: new URLs are signed with a new key ...
    second = verbs._signing_key()
    assert second.kid != first.kid and second.secret != first.secret
    check(token, key=verbs._verifying_key(first.kid))  # ... and the old one's URLs still open
    with pytest.raises(PermissionDenied):
        check(token, key=verbs._verifying_key(second.kid))
    make_older(verbs, first.kid, 600)  # now older than rotation + URL lifetime: retired
    assert verbs._verifying_key(first.kid) is None
    with pytest.raises(PermissionDenied):
        check(token, key=verbs._verifying_key(first.kid))
    assert verbs._verifying_key("no-such-kid") is None
