"""scheduler/db/signing_keys.py: one current key per purpose, rotated by age, older keys still found
by id (within a maximum age), and replicas that rotate at once agreeing on one key (PostgreSQL)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import sessionmaker

from temper.scheduler.db import models as m
from temper.scheduler.db import signing_keys
from temper.scheduler.db.store import make_engine, upgrade_schema


@pytest.fixture
def sqlite_sessions(tmp_path):
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    upgrade_schema(url)
    engine = make_engine(url)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


def age(sessions, kid: str, seconds: float) -> None:
    with sessions.begin() as db:
        row = db.get(m.SigningKey, kid)
        db.execute(update(m.SigningKey).where(m.SigningKey.kid == kid)
                   .values(created_at=row.created_at - timedelta(seconds=seconds)))


def test_current_key_is_made_once_kept_then_rotated_and_older_keys_stay_readable(sqlite_sessions):
    with sqlite_sessions.begin() as db:
        first = signing_keys.current_key(db, "jwt", rotate_after_seconds=3600)
    assert len(first.secret) == signing_keys.SECRET_BYTES and first.purpose == "jwt"
    assert abs(first.created_unix - time.time()) < 60
    assert "secret" not in repr(first) and first.secret.hex() not in repr(first)
    with sqlite_sessions.begin() as db:
        assert signing_keys.current_key(db, "jwt", rotate_after_seconds=3600) == first
        download = signing_keys.current_key(db, "download", rotate_after_seconds=3600)
    assert download.kid != first.kid  # purposes never share a key
    age(sqlite_sessions, first.kid, 7200)
    with sqlite_sessions.begin() as db:
        second = signing_keys.current_key(db, "jwt", rotate_after_seconds=3600)
    assert second.kid != first.kid and second.secret != first.secret
    with sqlite_sessions() as db:
        assert signing_keys.current_key(db, "jwt", rotate_after_seconds=3600) == second
        assert signing_keys.key_by_id(db, "jwt", first.kid).secret == first.secret  # still verifies old tokens
        assert signing_keys.key_by_id(db, "jwt", first.kid, max_age_seconds=3600) is None  # nothing it signed lives
        assert signing_keys.key_by_id(db, "jwt", second.kid, max_age_seconds=3600) == second
        assert signing_keys.key_by_id(db, "download", first.kid) is None  # another purpose's kid
        assert signing_keys.key_by_id(db, "jwt", "no-such-kid") is None
    with sqlite_sessions.begin() as db, pytest.raises(ValueError):
        signing_keys.current_key(db, "jwt", rotate_after_seconds=0)


def test_replicas_rotating_at_once_agree_on_one_key(postgres_url):
    upgrade_schema(postgres_url)
    engine = make_engine(postgres_url, pool_size=8)
    sessions = sessionmaker(engine, expire_on_commit=False)
    barrier = threading.Barrier(6)
    got: list[signing_keys.SigningKey] = []

    def replica():
        barrier.wait()
        with sessions.begin() as db:
            got.append(signing_keys.current_key(db, "race", rotate_after_seconds=3600))

    try:
        threads = [threading.Thread(target=replica) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(got) == 6 and len({key.kid for key in got}) == 1 and len({key.secret for key in got}) == 1
        with sessions() as db:
            assert db.scalar(select(func.count()).select_from(m.SigningKey).where(m.SigningKey.purpose == "race")) == 1
    finally:
        engine.dispose()
