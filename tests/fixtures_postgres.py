"""pytest plugin: a real PostgreSQL database for tests (load with ``pytest_plugins = ["fixtures_postgres"]``).

Fixtures
  ``postgres_server_url``  session: SQLAlchemy URL of a maintenance database on a working server.
  ``postgres_url``         session: URL (``postgresql+psycopg2://...``) of a FRESH, empty database,
                           dropped at the end of the session.
  ``new_postgres_database`` session: a callable returning the URL of another fresh database, for
                           tests that need isolation from the session one (all dropped at the end).

Where the server comes from, in order (``TEMPER_TEST_POSTGRES_MODE=auto``, the default):
  1. ``TEMPER_TEST_POSTGRES_URL`` (any SQLAlchemy/libpq URL with rights to CREATE DATABASE);
  2. a server answering on 127.0.0.1:5432 as user ``postgres`` (trust auth, as on dev and CI machines);
  3. a throwaway cluster: ``initdb -A trust -U postgres`` in a temporary folder and ``pg_ctl start``
     on a free port (socket in that folder), stopped and deleted at the end of the session. The
     binaries come from PATH or /usr/lib/postgresql/*/bin. As root, initdb and postgres run as
     the ``postgres`` OS user if there is one, else ``nobody`` (PostgreSQL refuses to run as root).

``TEMPER_TEST_POSTGRES_MODE`` = ``url`` | ``local`` | ``throwaway`` forces one of these sources
(e.g. ``TEMPER_TEST_POSTGRES_MODE=throwaway pytest tests/test_migrations.py`` tests step 3).
When no source works the requesting test FAILS with every reason; it is never skipped.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

ENV_URL = "TEMPER_TEST_POSTGRES_URL"
ENV_MODE = "TEMPER_TEST_POSTGRES_MODE"
MODES = ("auto", "url", "local", "throwaway")
LOCAL_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"


class PostgresUnavailable(RuntimeError):
    pass


def _psycopg2_url(raw: str | URL) -> URL:
    url = make_url(raw)
    if url.get_backend_name() != "postgresql":
        raise PostgresUnavailable(f"{ENV_URL} must be a postgresql URL, got {url.drivername!r}")
    return url.set(drivername="postgresql+psycopg2", database=url.database or "postgres")


def _render(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def _admin_engine(url: URL):
    return create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool, connect_args={"connect_timeout": 5})


def _probe(url: URL) -> None:
    """Raise PostgresUnavailable unless the server answers and lets us create databases."""
    try:
        with _admin_engine(url).connect() as conn:
            can_create = conn.execute(
                text("SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user")
            ).scalar()
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable", reported verbatim
        raise PostgresUnavailable(f"{url.render_as_string()}: {type(exc).__name__}: {exc}".strip()) from exc
    if not can_create:
        raise PostgresUnavailable(f"{url.render_as_string()}: role may not CREATE DATABASE")


# --- throwaway cluster -------------------------------------------------------------------------


def _find_pg_bin() -> Path:
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    versions = glob.glob("/usr/lib/postgresql/*/bin") + glob.glob("/usr/pgsql-*/bin")
    candidates += sorted((Path(p) for p in versions), key=lambda p: _version_key(p), reverse=True)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    raise PostgresUnavailable("initdb/pg_ctl not found on PATH nor in /usr/lib/postgresql/*/bin")


def _version_key(path: Path) -> tuple[int, ...]:
    digits = "".join(c if c.isdigit() else " " for c in str(path))
    return tuple(int(part) for part in digits.split()) or (0,)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class _Throwaway:
    root: Path
    bin_dir: Path
    port: int
    run_as: dict = field(default_factory=dict)
    server_url: URL | None = None

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def _run(self, args: list[str], log_name: str, timeout: float) -> None:
        log = self.root / log_name
        with open(log, "wb") as out:
            proc = subprocess.run(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                cwd=self.root, env={**os.environ, "LC_ALL": "C"}, **self.run_as,
            )
        if proc.returncode != 0:
            detail = log.read_text(errors="replace")[-2000:]
            server_log = self.root / "server.log"
            if server_log.exists():
                detail += "\n--- server.log ---\n" + server_log.read_text(errors="replace")[-2000:]
            raise PostgresUnavailable(f"{' '.join(args[:2])} exited {proc.returncode}:\n{detail}")

    def start(self) -> URL:
        self._run(
            [str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-A", "trust", "-U", "postgres",
             "-E", "UTF8", "--no-locale", "--no-sync"],
            "initdb.log", timeout=120,
        )
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._run(
            [str(self.bin_dir / "pg_ctl"), "start", "-D", str(self.data_dir), "-l", str(self.root / "server.log"),
             "-o", options, "-w", "-t", "60"],
            "pg_ctl-start.log", timeout=90,
        )
        return make_url(f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres")

    def stop(self) -> None:
        try:
            if (self.data_dir / "postmaster.pid").exists():
                self._run([str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w"],
                          "pg_ctl-stop.log", timeout=60)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _unprivileged_user() -> dict:
    """subprocess kwargs that drop root (PostgreSQL refuses to run as root); {} when not root."""
    if os.geteuid() != 0:
        return {}
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    raise PostgresUnavailable("running as root and neither a 'postgres' nor a 'nobody' OS user exists for initdb")


def _start_throwaway() -> _Throwaway:
    bin_dir = _find_pg_bin()
    run_as = _unprivileged_user()
    # Not pytest's tmp_path: its parents are mode 0700 and root-owned, closed to the postgres user.
    root = Path(tempfile.mkdtemp(prefix="temper-pg-"))
    if run_as:
        os.chown(root, run_as["user"], run_as["group"])
    cluster = _Throwaway(root=root, bin_dir=bin_dir, port=_free_port(), run_as=run_as)
    try:
        cluster.server_url = cluster.start()
        _probe(cluster.server_url)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server_url(request) -> str:
    mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        pytest.fail(f"{ENV_MODE}={mode!r}: expected one of {', '.join(MODES)}", pytrace=False)
    reasons: list[str] = []

    if mode in ("auto", "url"):
        raw = os.environ.get(ENV_URL)
        if raw:
            try:
                url = _psycopg2_url(raw)
                _probe(url)
                return _render(url)
            except PostgresUnavailable as exc:
                reasons.append(f"{ENV_URL}: {exc}")
                if mode == "auto":  # an explicit URL that does not work is an error, not a fallback
                    pytest.fail("PostgreSQL for tests: " + "; ".join(reasons), pytrace=False)
        else:
            reasons.append(f"{ENV_URL} is not set")

    if mode in ("auto", "local"):
        try:
            url = make_url(LOCAL_URL)
            _probe(url)
            return _render(url)
        except PostgresUnavailable as exc:
            reasons.append(f"local server: {exc}")

    if mode in ("auto", "throwaway"):
        try:
            cluster = _start_throwaway()
        except (PostgresUnavailable, OSError, subprocess.SubprocessError) as exc:
            reasons.append(f"throwaway cluster: {exc}")
        else:
            request.addfinalizer(cluster.stop)
            return _render(cluster.server_url)

    pytest.fail(
        "a test needs PostgreSQL and none could be had (tests needing Postgres are never skipped):\n  - "
        + "\n  - ".join(reasons),
        pytrace=False,
    )


@pytest.fixture(scope="session")
def new_postgres_database(postgres_server_url):
    """Callable: create a uniquely named empty database and return its URL; all dropped at the end."""
    server = make_url(postgres_server_url)
    created: list[str] = []

    def create(prefix: str = "temper_test") -> str:
        name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        with _admin_engine(server).connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        return _render(server.set(database=name))

    yield create

    engine = _admin_engine(server)
    with engine.connect() as conn:
        for name in created:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


@pytest.fixture(scope="session")
def postgres_url(new_postgres_database) -> str:
    """SQLAlchemy URL (postgresql+psycopg2://...) of a fresh, empty database for this test session."""
    return new_postgres_database()
