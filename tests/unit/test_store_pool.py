"""The scheduler's database pool keeps one connection per thread that can hold one at once.

Every store call runs in asyncio's default executor (``asyncio.to_thread``). With SQLAlchemy's
default pool of 5, a sixth concurrent transaction opened an overflow connection and closed it on
return: under load, a new PostgreSQL backend (a fork, a login) for every such transaction, the
scheduler's ceiling lost to connecting (benchmarks/README.md, scaleout)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import event, text

from temper.scheduler.db.store import executor_threads, make_engine


def _bursts(engine, threads: int, bursts: int) -> int:
    """``bursts`` times, ``threads`` transactions held open at once; the connections opened meanwhile."""
    opened = []
    event.listen(engine, "connect", lambda *_: opened.append(1))
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(bursts):
            together = threading.Barrier(threads, timeout=60)  # the timeout only keeps a broken pool from hanging the test

            def transaction():
                with engine.begin() as conn:
                    conn.execute(text("SELECT 1"))
                    together.wait()  # every thread holds its connection at this moment

            for future in [pool.submit(transaction) for _ in range(threads)]:
                future.result()
    return len(opened)


def test_postgres_pool_keeps_a_connection_per_executor_thread(postgres_url):
    engine = make_engine(postgres_url)
    try:
        threads = executor_threads()
        assert _bursts(engine, threads, bursts=3) == threads  # opened once each, then reused: none closed and reopened
    finally:
        engine.dispose()


def test_sqlite_pool_keeps_a_connection_per_executor_thread(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'pool.db'}")
    try:
        threads = executor_threads()
        assert _bursts(engine, threads, bursts=3) == threads
    finally:
        engine.dispose()
