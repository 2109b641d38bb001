"""The scheduler's Store on a real Postgres: concurrency and outages."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import create_engine, text

from temper.common.errors import Unavailable
from temper.scheduler.db.store import Store, upgrade_schema


def test_concurrent_first_sessions_of_a_new_tenant_all_succeed(new_postgres_database):
    url = new_postgres_database()
    upgrade_schema(url)
    stores = [Store(url) for _ in range(8)]  # as many connections as callers: a real race on the insert
    with ThreadPoolExecutor(8) as pool:
        sessions = list(pool.map(lambda s: s.create_session("newcomer", [], {}), stores))
    assert len({s.id for s in sessions}) == 8
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("select count(*) from tenants where name = 'newcomer'")).scalar() == 1
    engine.dispose()


def test_an_unreachable_database_is_unavailable_not_a_driver_error():
    import socket

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = Store(f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres")
    with pytest.raises(Unavailable, match="database is unavailable"):
        store.create_session("t", [], {})
    with pytest.raises(Unavailable):
        store.get_request("run", 1)
