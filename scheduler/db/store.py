"""Database access for the scheduler: small synchronous methods, each one transaction.

The async servicer calls them through ``asyncio.to_thread``. Rows come back detached
(``expire_on_commit=False``) so callers read attributes without a live session.
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, event, func, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from temper.common.errors import AlreadyExists, FailedPrecondition, NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.access import ReadAccess
from temper.scheduler.db.audit import Actor, AuditStore, record
from temper.scheduler.db.outage import database_errors, now
from temper.scheduler.db.records import RecordsStore
from temper.scheduler.db.request_log import RequestLogStore, no_fence
from temper.scheduler.db.catalog import CatalogStore
from temper.scheduler.db.images import ImageStore
from temper.scheduler.db.inflight import InflightStore
from temper.scheduler.db.projects import EXPIRED, ProjectStore
from temper.scheduler.db.session_search import SessionSearchStore
from temper.scheduler.db.tenancy import TenancyStore, listed

def executor_threads() -> int:
    """The threads of asyncio's default executor, where every store call runs (``asyncio.to_thread``)."""
    return min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default max_workers


def _pool(pool_size: int | None = None) -> dict:
    """A pooled connection for every executor thread: with SQLAlchemy's default of 5, each transaction
    beyond 5 at once opened a connection and closed it on return (a PostgreSQL backend each, under load)."""
    return {"pool_size": pool_size or executor_threads(), "max_overflow": 10}


def make_engine(url: str, pool_size: int | None = None):
    """``pool_size``: default, one connection per executor thread (replicas' lease calls use a pool of their own)."""
    if url.startswith("sqlite"):
        in_memory = make_url(url).database in (None, "", ":memory:")  # one shared connection (SingletonThreadPool): not sized
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **({} if in_memory else _pool()))

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):  # WAL lets readers run beside the single writer
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    # A refused or hung connection fails in seconds (then Unavailable), not at the OS's TCP timeout.
    # psycopg2: an executemany UPDATE (a cycle's outcomes, request_log.py) is one round trip, not one per row.
    # No pre-ping (a SELECT 1 round trip on every checkout, a sixth of the hot path's statements): a
    # connection the server dropped fails its statement as a disconnect, SQLAlchemy then discards the
    # whole pool, and the caller gets Unavailable and retries (outage.py), as for any outage.
    batch = {"executemany_mode": "values_plus_batch"} if make_url(url).get_driver_name() == "psycopg2" else {}
    return create_engine(url, connect_args={"connect_timeout": 5}, **batch, **_pool(pool_size))


def upgrade_schema(url: str) -> None:
    """alembic upgrade head on ``url`` (the scheduler's start-up migration)."""
    from alembic import command
    from alembic.config import Config

    # The repo (or image working directory) holds alembic.ini and migrations/.
    candidates = [Path.cwd(), Path(__file__).resolve().parents[2]]
    root = next((c for c in candidates if (c / "alembic.ini").is_file() and (c / "migrations").is_dir()), None)
    if root is None:
        raise RuntimeError(f"alembic.ini and migrations/ not found in {[str(c) for c in candidates]}")
    cfg = Config(str(root / "alembic.ini"))
    cfg.set_main_option("script_location", str(root / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url)
    cfg.attributes["configure_logger"] = False
    command.upgrade(cfg, "head")


@database_errors
class Store(TenancyStore, RequestLogStore, CatalogStore, AuditStore, RecordsStore, ImageStore, InflightStore, ProjectStore,
            SessionSearchStore):
    def __init__(self, url: str):
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.engine = make_engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.read_access = ReadAccess(now)
        self.fence_runs = no_fence  # replicas: scheduler/cluster/ownership.py

    # ---- tenants and sessions -----------------------------------------------------------------

    def ensure_tenant(self, name: str) -> int:
        for attempt in range(3):
            try:
                with self.sessions.begin() as db:
                    tenant = db.scalar(select(m.Tenant).where(m.Tenant.name == name))
                    if tenant is None:
                        tenant = m.Tenant(name=name, weight=1.0)
                        db.add(tenant)
                        db.flush()
                    return tenant.id
            except IntegrityError:
                if attempt == 2:
                    raise
                # Another request created the same new tenant first: read its row.
        raise AssertionError("unreachable")

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        for name, weight in weights.items():
            self.ensure_tenant(name)
            with self.sessions.begin() as db:
                db.execute(update(m.Tenant).where(m.Tenant.name == name).values(weight=float(weight)))

    def tenant_weights(self) -> dict[str, float]:
        with self.sessions() as db:
            return {t.name: t.weight for t in db.scalars(select(m.Tenant))}

    def tenant_of_session(self, session_id: str) -> str:
        with self.sessions() as db:
            name = db.scalar(select(m.Tenant.name).join(m.Session, m.Session.tenant_id == m.Tenant.id).where(m.Session.id == session_id))
        if name is None:
            raise NotFound(f"session {session_id!r} not found")
        return name

    def create_session(self, tenant: str, tags: list[str], metadata: dict[str, str], actor: Actor | None = None,
                       display_name: str = "", project_id: str = "") -> m.Session:
        """``project_id``: one of the tenant's projects (NotFound otherwise, nothing created)."""
        tenant_id = self.ensure_tenant(tenant)
        self.check_projects([project_id] if project_id else [], tenant)
        with self.sessions.begin() as db:
            row = m.Session(id=str(uuid.uuid4()), tenant_id=tenant_id, tags=list(tags), user_metadata=dict(metadata),
                            display_name=display_name or None, project_id=project_id or None)
            db.add(row)
            record(db, actor, "session.open", tenant, row.id, **({"project_id": project_id} if project_id else {}))
            return row

    def open_session(self, session_id: str, tenant: str | None = None) -> m.Session:
        """The open session; NotFound when it does not exist or (``tenant`` given) is another tenant's."""
        with self.sessions() as db:
            found = db.execute(select(m.Session, m.Tenant.name).join(m.Tenant, m.Tenant.id == m.Session.tenant_id)
                               .where(m.Session.id == session_id)).first()
        if found is None or (tenant is not None and found[1] != tenant):
            raise NotFound(f"session {session_id!r} not found")
        row = found[0]
        if row.closed_at is not None:
            why = "expired (no heartbeat within the scheduler's session_expire_seconds)" if row.close_status == EXPIRED else "closed"
            raise FailedPrecondition(f"session {session_id} is {why}")
        return row

    def heartbeat(self, session_id: str, tenant: str | None = None) -> None:
        self.open_session(session_id, tenant)
        with self.sessions.begin() as db:
            db.execute(update(m.Session).where(m.Session.id == session_id).values(last_heartbeat_at=_now()))

    def close_session(self, session_id: str, status: str, tenant: str | None = None, actor: Actor | None = None) -> None:
        self.open_session(session_id, tenant)
        owner = tenant or self.tenant_of_session(session_id)
        with self.sessions.begin() as db:
            closed = db.execute(update(m.Session).where(m.Session.id == session_id, m.Session.closed_at.is_(None))
                                .values(closed_at=_now(), close_status=status)).rowcount
            if closed:  # a close racing another: one of them closed it, and only that one is logged
                record(db, actor, "session.close", owner, session_id, status=status)

    # ---- training runs ------------------------------------------------------------------------

    def next_run_id(self, session_id: str) -> str:
        """Reserve the next "<session>:train:<n>" id (the row is inserted by add_training_run)."""
        with self.sessions.begin() as db:
            row = db.get(m.Session, session_id, with_for_update=True)
            n = row.num_training_runs
            row.num_training_runs = n + 1
            return f"{session_id}:train:{n}"

    def add_training_run(self, run: m.TrainingRun) -> m.TrainingRun:
        with self.sessions.begin() as db:
            db.add(run)
            return run

    def get_training_run(self, run_id: str) -> m.TrainingRun:
        with self.sessions() as db:
            row = db.get(m.TrainingRun, run_id)
        if row is None:
            raise NotFound(f"training run {run_id!r} not found")
        return row

    # ---- sequenced requests -------------------------------------------------------------------

    def load_run(self, run_id: str) -> tuple[m.TrainingRun, str, bool, int]:
        """A run as an earlier process left it, its tenant, whether its session is closed, and the highest
        seq it has a request row for (0: none). Requests it left "queued" or "running" stay so: each is
        sent again when its client resends it (a trainer answers a seq it applied from memory; a save or
        load resent is safe to run again: loop.py::_save, _load)."""
        run = self.get_training_run(run_id)
        with self.sessions() as db:
            closed = db.scalar(select(m.Session.closed_at).where(m.Session.id == run.session_id)) is not None
            recorded = db.scalar(select(func.max(m.RequestRecord.seq_id)).where(m.RequestRecord.training_run_id == run_id)) or 0
        return run, self.tenant_of_session(run.session_id), closed, recorded

    def session_closed(self, session_id: str) -> bool:
        with self.sessions() as db:
            row = db.get(m.Session, session_id)
        if row is None:
            raise NotFound(f"session {session_id!r} not found")
        return row.closed_at is not None

    # ---- checkpoints --------------------------------------------------------------------------

    def checkpoint_exists(self, run_id: str, kind: str, name: str) -> bool:
        with self.sessions() as db:
            return db.scalar(select(m.Checkpoint.id).where(
                m.Checkpoint.training_run_id == run_id, m.Checkpoint.kind == kind, m.Checkpoint.name == name)) is not None

    def add_checkpoint(self, run_id: str, kind: str, name: str, path: str, size_bytes: int, ephemeral: bool = False,
                       ttl_seconds: int = 0, user_metadata: dict[str, str] | None = None, lane_write: bool = False,
                       actor: Actor | None = None) -> m.Checkpoint:
        """``lane_write``: a save of the run's lane (fenced: replicas), not an import's or a copy's row;
        a save is logged (checkpoint.save, for ``actor.tenant``) in its row's transaction, so a save
        resent after its answer was lost (the row exists) is logged once."""
        expires_at = _now() + timedelta(seconds=ttl_seconds) if ttl_seconds > 0 else None
        try:
            with self.sessions.begin() as db:
                if lane_write:
                    self.fence_runs(db, {run_id})
                row = m.Checkpoint(training_run_id=run_id, kind=kind, name=name, path=path, size_bytes=size_bytes,
                                   ephemeral=ephemeral, expires_at=expires_at, user_metadata=dict(user_metadata or {}))
                db.add(row)
                if lane_write and actor is not None:
                    db.flush()  # a taken path raises IntegrityError here, before any entry
                    record(db, actor, "checkpoint.save", actor.tenant, path, kind=kind, size_bytes=size_bytes,
                           **({"temporary": True} if ephemeral else {}), **({"ttl_seconds": ttl_seconds} if ttl_seconds else {}))
                return row
        except IntegrityError:
            raise AlreadyExists(f"checkpoint {path} already exists") from None

    def add_or_get_checkpoint(self, run_id: str, kind: str, name: str, path: str, size_bytes: int, ephemeral: bool = False,
                              ttl_seconds: int = 0, user_metadata: dict[str, str] | None = None,
                              actor: Actor | None = None) -> m.Checkpoint:
        """add_checkpoint, or the row an earlier attempt of the same save wrote (its answer was lost)."""
        try:
            return self.add_checkpoint(run_id, kind, name, path, size_bytes, ephemeral, ttl_seconds, user_metadata, lane_write=True,
                                       actor=actor)
        except AlreadyExists:
            return self.get_checkpoint(path)

    def get_checkpoint(self, path: str) -> m.Checkpoint:
        with self.sessions() as db:
            row = db.scalar(select(m.Checkpoint).where(m.Checkpoint.path == path))
        if row is None:
            raise NotFound(f"checkpoint {path} not found")
        return row

    def list_checkpoints(self, run_id: str, include_temporary: bool = False) -> list[m.Checkpoint]:
        self.get_training_run(run_id)
        with self.sessions() as db:
            return list(db.scalars(select(m.Checkpoint).where(m.Checkpoint.training_run_id == run_id,
                                                              listed(include_temporary)).order_by(m.Checkpoint.id)))

    # ---- sampling clients ---------------------------------------------------------------------

    def add_sampling_client(self, session_id: str, base_model: str, model_path: str | None, deterministic: bool = False,
                            inflight_run_id: str | None = None, min_version: int | None = None) -> m.SamplingClient:
        """``inflight_run_id``: an in-flight client following that run's target from ``min_version`` on."""
        with self.sessions.begin() as db:
            session = db.get(m.Session, session_id, with_for_update=True)
            n = session.num_samplers
            session.num_samplers = n + 1
            row = m.SamplingClient(id=f"{session_id}:sample:{n}", session_id=session_id, base_model=base_model, model_path=model_path,
                                   deterministic=deterministic, inflight_run_id=inflight_run_id, min_version=min_version)
            db.add(row)
            return row

    def add_sampled_tokens(self, sampler_id: str, tokens: int) -> None:
        with self.sessions.begin() as db:
            db.execute(update(m.SamplingClient).where(m.SamplingClient.id == sampler_id)
                       .values(tokens_sampled=m.SamplingClient.tokens_sampled + tokens))

    def usage(self, tenant: str) -> tuple[float, list[m.TrainingRun], list[m.SamplingClient]]:
        """The tenant's weight, training runs and sampling clients (with their counters)."""
        with self.sessions() as db:
            row = db.scalar(select(m.Tenant).where(m.Tenant.name == tenant))
            if row is None:
                return 1.0, [], []
            sessions = select(m.Session.id).where(m.Session.tenant_id == row.id)
            runs = list(db.scalars(select(m.TrainingRun).where(m.TrainingRun.session_id.in_(sessions)).order_by(m.TrainingRun.created_at)))
            samplers = list(db.scalars(select(m.SamplingClient).where(m.SamplingClient.session_id.in_(sessions)).order_by(m.SamplingClient.created_at)))
            return row.weight, runs, samplers

    def get_sampling_client(self, sampler_id: str, tenant: str | None = None) -> tuple[m.SamplingClient, str, bool]:
        """The sampling client, its tenant and whether its session is closed; NotFound for another tenant's."""
        with self.sessions() as db:
            found = db.execute(select(m.SamplingClient, m.Tenant.name, m.Session.closed_at)
                               .join(m.Session, m.Session.id == m.SamplingClient.session_id)
                               .join(m.Tenant, m.Tenant.id == m.Session.tenant_id).where(m.SamplingClient.id == sampler_id)).first()
        if found is None or (tenant is not None and found[1] != tenant):
            raise NotFound(f"sampling client {sampler_id!r} not found")
        return found[0], found[1], found[2] is not None


def _now() -> datetime:
    return now()
