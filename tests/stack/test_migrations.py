"""Alembic migrations against real PostgreSQL (tests/fixtures_postgres.py) and SQLite.

Upgrading to head must produce exactly the schema of temper.scheduler.db.models (no pending
autogenerate diff), the constraints must hold in the database, and downgrading must undo it all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.pool import NullPool

from temper.scheduler.db import models

REPO = Path(__file__).resolve().parents[2]
EXPECTED_TABLES = {"tenants", "sessions", "training_runs", "checkpoints", "sampling_clients", "requests", "api_keys",
                   "run_metrics", "sampling_records", "audit_log", "images", "lane_leases", "scheduler_replicas",
                   "signing_keys", "projects"}


def alembic_config() -> Config:
    cfg = Config(str(REPO / "alembic.ini"))
    cfg.attributes["configure_logger"] = False  # keep pytest's logging setup (migrations/env.py honours this)
    return cfg


@pytest.fixture
def migrate(monkeypatch):
    """migrate(url, 'upgrade'|'downgrade', revision): run alembic the way deployment does (TEMPER_SCHEDULER_DATABASE_URL)."""

    def run(url: str, direction: str, revision: str) -> None:
        monkeypatch.setenv("TEMPER_SCHEDULER_DATABASE_URL", url)
        getattr(command, direction)(alembic_config(), revision)

    return run


def pending_diff(url: str) -> list:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), models.Base.metadata)
    finally:
        engine.dispose()


def table_names(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_single_head():
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    assert len(heads) == 1, f"alembic has several heads, merge them: {heads}"


def test_postgres_database_fixtures_are_fresh(postgres_url, new_postgres_database):
    # (the session database may already hold the schema: stack tests that ran earlier migrated it)
    assert postgres_url.startswith("postgresql+psycopg2://")
    url = new_postgres_database()
    assert url != postgres_url and table_names(url) == set()


def test_postgres_upgrade_constraints_downgrade(new_postgres_database, migrate):
    url = new_postgres_database("temper_migrations")
    migrate(url, "upgrade", "head")

    assert pending_diff(url) == [], "models and migrations differ: add a migration (alembic revision --autogenerate)"
    assert table_names(url) == EXPECTED_TABLES | {"alembic_version"}

    engine = create_engine(url, poolclass=NullPool)
    try:
        with OrmSession(engine) as db:
            tenant = models.Tenant(name="t")
            db.add(tenant)
            db.flush()
            db.add(models.Session(id="s1", tenant_id=tenant.id))
            db.flush()
            db.add(models.TrainingRun(
                id="s1:train:0", session_id="s1", base_model="m", lora_rank=8, lora_alpha=32.0,
                train_attn=True, train_mlp=True, train_unembed=False,
            ))
            db.flush()
            for seq in (1, 2):
                db.add(models.RequestRecord(
                    training_run_id="s1:train:0", seq_id=seq, kind="forward_backward", payload_sha256="0" * 64, status="queued",
                ))
            db.commit()

            db.add(models.RequestRecord(
                training_run_id="s1:train:0", seq_id=1, kind="forward", payload_sha256="1" * 64, status="queued",
            ))
            with pytest.raises(IntegrityError, match="uq_request_run_seq"):
                db.commit()
            db.rollback()

            # A foreign key to a run that does not exist is refused too.
            db.add(models.RequestRecord(
                training_run_id="nope", seq_id=1, kind="forward", payload_sha256="2" * 64, status="queued",
            ))
            with pytest.raises(IntegrityError):
                db.commit()
            db.rollback()
            assert db.query(models.RequestRecord).count() == 2
    finally:
        engine.dispose()

    migrate(url, "downgrade", "base")
    assert table_names(url) == {"alembic_version"}


def test_sqlite_upgrade_matches_models(tmp_path, migrate):
    url = f"sqlite:///{tmp_path / 'temper.db'}"
    migrate(url, "upgrade", "head")
    assert pending_diff(url) == []
    assert table_names(url) == EXPECTED_TABLES | {"alembic_version"}
    migrate(url, "downgrade", "base")
    assert table_names(url) == {"alembic_version"}
