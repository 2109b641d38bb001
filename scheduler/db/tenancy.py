"""What belongs to whom: API keys, per-tenant limits, and checkpoints seen through their owner.

A mixin of ``Store`` (same engine, same one-transaction-per-method rule). Lookups of another
tenant's objects raise the same NotFound as objects that do not exist: a caller never learns that
someone else's id is real.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select, update

from temper.common.errors import InvalidArgument, NotFound, Unauthenticated
from temper.scheduler.db import keys, signing_keys
from temper.scheduler.db import models as m
from temper.scheduler.db.access import ReadAccess, ReadFacts
from temper.scheduler.db.audit import Actor, record
from temper.scheduler.db.outage import database_errors, now

LIMIT_COLUMNS = ("max_training_runs", "max_resident_adapters", "max_queued_requests", "train_tokens_per_minute",
                 "sample_tokens_per_minute", "max_storage_bytes")
LAST_USED_RESOLUTION = timedelta(seconds=60)  # last_used_at is written at most this often per key
MAX_KEY_ID = 2**31 - 1  # api_keys.id is an INTEGER


@dataclass(frozen=True)
class KeyIdentity:
    """Who a valid key is: its tenant, id, prefix and role."""

    tenant: str
    key_id: int
    prefix: str
    is_admin: bool


@database_errors
class TenancyStore:
    sessions = None  # sessionmaker, set by Store
    read_access: ReadAccess = None  # set by Store: who may read a checkpoint, kept exact (access.py)

    # ---- API keys -----------------------------------------------------------------------------

    def create_api_key(self, tenant: str, label: str = "", is_admin: bool = False,
                       actor: Actor | None = None) -> tuple[str, m.ApiKey]:
        """A new key for ``tenant`` (created if new). The key itself is returned once and never stored."""
        tenant_id = self.ensure_tenant(tenant)
        key = keys.new_key()
        with self.sessions.begin() as db:
            row = m.ApiKey(tenant_id=tenant_id, prefix=keys.prefix(key), key_sha256=keys.digest(key), label=label,
                           is_admin=is_admin)
            db.add(row)
            db.flush()
            record(db, actor, "api_key.create", tenant, row.prefix, key_id=row.id, label=label, is_admin=is_admin)
        return key, row

    def list_api_keys(self, tenant: str | None = None) -> list[tuple[m.ApiKey, str]]:
        with self.sessions() as db:
            query = select(m.ApiKey, m.Tenant.name).join(m.Tenant, m.Tenant.id == m.ApiKey.tenant_id).order_by(m.ApiKey.id)
            if tenant is not None:
                query = query.where(m.Tenant.name == tenant)
            return [(row, name) for row, name in db.execute(query).all()]

    def revoke_api_key(self, key_ref: str, tenant: str | None = None, actor: Actor | None = None) -> m.ApiKey:
        """Revoke by the key's id or its prefix (as list-keys shows them), or by the whole key; with
        ``tenant``, only that tenant's keys (another's: the same NotFound as none). Revoking a revoked
        key changes nothing (and is not logged again)."""
        with self.sessions.begin() as db:
            query = select(m.ApiKey, m.Tenant.name).join(m.Tenant, m.Tenant.id == m.ApiKey.tenant_id)
            if key_ref.isdigit():
                if int(key_ref) > MAX_KEY_ID:
                    raise NotFound(f"no API key {key_ref[:keys.PREFIX_LENGTH + 4]!r}")
                query = query.where(m.ApiKey.id == int(key_ref))
            elif key_ref.startswith(keys.PREFIX) and len(key_ref) > keys.PREFIX_LENGTH:
                query = query.where(m.ApiKey.key_sha256 == keys.digest(key_ref))
            else:
                query = query.where(m.ApiKey.prefix == key_ref)
            if tenant is not None:
                query = query.where(m.Tenant.name == tenant)
            rows = db.execute(query).all()
            if not rows:
                raise NotFound(f"no API key {key_ref[:keys.PREFIX_LENGTH + 4]!r}")
            if len(rows) > 1:
                raise InvalidArgument(f"{len(rows)} keys have the prefix {key_ref!r}; revoke by id")
            row, owner = rows[0]
            if row.revoked_at is None:
                row.revoked_at = now()
                record(db, actor, "api_key.revoke", owner, row.prefix, key_id=row.id)
            return row

    def tenant_for_key(self, key: str) -> str:
        """The tenant of a valid key (and its last use recorded); Unauthenticated otherwise."""
        return self.key_identity(key).tenant

    def key_identity(self, key: str) -> KeyIdentity:
        """Who a valid key is (and its last use recorded); Unauthenticated otherwise."""
        return self._live_key(m.ApiKey.key_sha256 == keys.digest(key), "unknown API key", "was revoked")

    def key_identity_by_id(self, key_id: int) -> KeyIdentity:
        """Who the key with this id is, if it is still live (a token's key: scheduler/tenancy/jwt_tokens.py);
        Unauthenticated if it is unknown or revoked. Its last use is recorded as key_identity does."""
        if not 0 < key_id <= MAX_KEY_ID:
            raise Unauthenticated(f"the token names no API key (id {key_id})")
        return self._live_key(m.ApiKey.id == key_id, f"the token's API key (id {key_id}) no longer exists",
                              "was revoked; its tokens are refused")

    def _live_key(self, which, unknown: str, revoked: str) -> KeyIdentity:
        with self.sessions.begin() as db:
            found = db.execute(select(m.ApiKey, m.Tenant.name).join(m.Tenant, m.Tenant.id == m.ApiKey.tenant_id)
                               .where(which)).first()
            if found is None:
                raise Unauthenticated(unknown)
            row, tenant = found
            if row.revoked_at is not None:
                raise Unauthenticated(f"API key {row.prefix}… {revoked}")
            if row.last_used_at is None or now() - _aware(row.last_used_at) > LAST_USED_RESOLUTION:
                row.last_used_at = now()
            return KeyIdentity(tenant, row.id, row.prefix, bool(row.is_admin))

    def current_signing_key(self, purpose: str, rotate_after_seconds: float) -> signing_keys.SigningKey:
        """The key to sign ``purpose``'s tokens with now (made or rotated here when due)."""
        with self.sessions.begin() as db:
            return signing_keys.current_key(db, purpose, rotate_after_seconds)

    def signing_key(self, purpose: str, kid: str, max_age_seconds: float | None = None) -> signing_keys.SigningKey | None:
        with self.sessions() as db:
            return signing_keys.key_by_id(db, purpose, kid, max_age_seconds)

    # ---- limits -------------------------------------------------------------------------------

    def set_limits(self, tenant: str, limits: dict[str, int | None], actor: Actor | None = None) -> dict[str, int | None]:
        """Set (an int, 0 = unlimited) or reset to the scheduler's default (None) some of a tenant's limits."""
        unknown = set(limits) - set(LIMIT_COLUMNS)
        if unknown:
            raise InvalidArgument(f"unknown limits {sorted(unknown)}; known: {list(LIMIT_COLUMNS)}")
        if any(v is not None and v < 0 for v in limits.values()):
            raise InvalidArgument("limits are >= 0 (0: unlimited)")
        self.ensure_tenant(tenant)
        with self.sessions.begin() as db:
            if limits:
                db.execute(update(m.Tenant).where(m.Tenant.name == tenant).values(**limits))
                record(db, actor, "quota.set", tenant, tenant, **{k: "default" if v is None else v for k, v in limits.items()})
        return self.tenant_limits(tenant)

    def tenant_limits(self, tenant: str) -> dict[str, int | None]:
        """The tenant's own limits (None: the scheduler's default applies)."""
        with self.sessions() as db:
            row = db.scalar(select(m.Tenant).where(m.Tenant.name == tenant))
        return {name: (getattr(row, name) if row is not None else None) for name in LIMIT_COLUMNS}

    def open_training_runs(self, tenant: str) -> int:
        """Training runs of the tenant whose session is open (what max_training_runs bounds)."""
        with self.sessions() as db:
            return db.scalar(select(func.count(m.TrainingRun.id)).join(m.Session, m.Session.id == m.TrainingRun.session_id)
                             .join(m.Tenant, m.Tenant.id == m.Session.tenant_id)
                             .where(m.Tenant.name == tenant, m.Session.closed_at.is_(None))) or 0

    def open_runs_per_trainer(self) -> dict[str, int]:
        """Training runs whose session is open, per trainer address: what placement balances when
        several scheduler replicas place runs (each knows only the runs it has seen)."""
        with self.sessions() as db:
            rows = db.execute(select(m.TrainingRun.trainer, func.count(m.TrainingRun.id))
                              .join(m.Session, m.Session.id == m.TrainingRun.session_id)
                              .where(m.Session.closed_at.is_(None)).group_by(m.TrainingRun.trainer)).all()
        return {trainer: count for trainer, count in rows if trainer}

    def storage_bytes(self, tenant: str) -> int:
        """What max_storage_bytes bounds: the tenant's checkpoints and its uploaded images (db/images.py)."""
        checkpoints = (select(func.coalesce(func.sum(m.Checkpoint.size_bytes), 0)).select_from(m.Checkpoint)
                       .join(m.TrainingRun, m.TrainingRun.id == m.Checkpoint.training_run_id)
                       .join(m.Session, m.Session.id == m.TrainingRun.session_id)
                       .join(m.Tenant, m.Tenant.id == m.Session.tenant_id).where(m.Tenant.name == tenant).scalar_subquery())
        images = (select(func.coalesce(func.sum(m.ImageAsset.size_bytes), 0)).select_from(m.ImageAsset)
                  .join(m.Tenant, m.Tenant.id == m.ImageAsset.tenant_id).where(m.Tenant.name == tenant).scalar_subquery())
        with self.sessions() as db:
            return int(db.scalar(select(checkpoints + images)) or 0)

    # ---- ownership ----------------------------------------------------------------------------

    def run_owner(self, run_id: str) -> str:
        with self.sessions() as db:
            name = db.scalar(select(m.Tenant.name).join(m.Session, m.Session.tenant_id == m.Tenant.id)
                             .join(m.TrainingRun, m.TrainingRun.session_id == m.Session.id).where(m.TrainingRun.id == run_id))
        if name is None:
            raise NotFound(f"training run {run_id!r} not found")
        return name

    def _checkpoint_and_owner(self, path: str) -> tuple[m.Checkpoint, str]:
        generation = self.read_access.generation()  # before the read: a change meanwhile is not remembered
        with self.sessions() as db:
            found = db.execute(select(m.Checkpoint, m.Tenant.name)
                               .join(m.TrainingRun, m.TrainingRun.id == m.Checkpoint.training_run_id)
                               .join(m.Session, m.Session.id == m.TrainingRun.session_id)
                               .join(m.Tenant, m.Tenant.id == m.Session.tenant_id).where(m.Checkpoint.path == path)).first()
        if found is None or (found[0].expires_at is not None and _aware(found[0].expires_at) <= now()):
            raise NotFound(f"checkpoint {path} not found")
        row, owner = found
        expires = _aware(row.expires_at) if row.expires_at is not None else None
        self.read_access.remember(path, ReadFacts(owner, bool(row.published), expires), generation)
        return row, owner

    def readable_checkpoint(self, path: str, tenant: str) -> m.Checkpoint:
        """The checkpoint if ``tenant`` owns it or its owner published it."""
        row, owner = self._checkpoint_and_owner(path)
        if owner != tenant and not row.published:
            raise NotFound(f"checkpoint {path} not found")
        return row

    def owned_checkpoint(self, path: str, tenant: str) -> m.Checkpoint:
        row, owner = self._checkpoint_and_owner(path)
        if owner != tenant:
            raise NotFound(f"checkpoint {path} not found")
        return row

    # ---- checkpoint lifecycle -----------------------------------------------------------------

    def update_checkpoint(self, path: str, tenant: str, published: bool | None, expires_at: datetime | None | bool,
                          actor: Actor | None = None, ttl_seconds: int | None = None) -> m.Checkpoint:
        """``expires_at``: a time, None to clear, False to leave as it is (``ttl_seconds``: what was asked, for the log).
        What is already so is left alone and not logged again (publishing a published checkpoint, a
        request resent, clearing no TTL): the log holds each change once."""
        row = self.owned_checkpoint(path, tenant)
        values = {}
        if published is not None and published != bool(row.published):
            values["published"] = published
        if expires_at is not False and not (expires_at is None and row.expires_at is None):
            values["expires_at"] = expires_at
        if values:
            with self.sessions.begin() as db:
                # the row as it is now, locked: of two concurrent identical requests only the first changes it
                current = db.scalar(select(m.Checkpoint).where(m.Checkpoint.id == row.id).with_for_update())
                if current is None:
                    raise NotFound(f"checkpoint {path} not found")
                if "published" in values and values["published"] == bool(current.published):
                    del values["published"]
                if values:
                    db.execute(update(m.Checkpoint).where(m.Checkpoint.id == row.id).values(**values))
                if "published" in values:
                    record(db, actor, "checkpoint.publish" if published else "checkpoint.unpublish", tenant, path)
                if "expires_at" in values:
                    record(db, actor, "checkpoint.ttl", tenant, path, ttl_seconds=ttl_seconds, expires_at=expires_at)
            self.read_access.forget(path)  # committed: the next call reads the new facts
        return self.owned_checkpoint(path, tenant)

    def delete_checkpoint_row(self, checkpoint_id: int, actor: Actor | None = None, reason: str = "") -> None:
        """The row goes with its audit entry (but for an in-flight version the scheduler collects: its
        save was not logged either, one per async-RL step)."""
        with self.sessions.begin() as db:
            row = db.get(m.Checkpoint, checkpoint_id)
            if row is not None:
                if actor is not None or row.inflight_version is None:
                    owner = db.scalar(select(m.Tenant.name).join(m.Session, m.Session.tenant_id == m.Tenant.id)
                                      .join(m.TrainingRun, m.TrainingRun.session_id == m.Session.id)
                                      .where(m.TrainingRun.id == row.training_run_id))
                    record(db, actor, "checkpoint.delete", owner or "", row.path, size_bytes=row.size_bytes,
                           **({"reason": reason} if reason else {}))
                db.delete(row)
        if row is not None:
            self.read_access.forget(row.path)  # committed: no call reads it from memory any more

    def touch_checkpoint(self, path: str) -> None:
        with self.sessions.begin() as db:
            db.execute(update(m.Checkpoint).where(m.Checkpoint.path == path).values(last_used_at=now()))

    def tenant_checkpoints(self, tenant: str, include_temporary: bool = False) -> list[m.Checkpoint]:
        """Every listed (not ephemeral) checkpoint of the tenant, oldest first; ``include_temporary``:
        also its temporary sampler snapshots (not the in-flight versions of async RL)."""
        with self.sessions() as db:
            return list(db.scalars(select(m.Checkpoint).join(m.TrainingRun, m.TrainingRun.id == m.Checkpoint.training_run_id)
                                   .join(m.Session, m.Session.id == m.TrainingRun.session_id)
                                   .join(m.Tenant, m.Tenant.id == m.Session.tenant_id)
                                   .where(m.Tenant.name == tenant, listed(include_temporary)).order_by(m.Checkpoint.id)))

    def collectable_checkpoints(self, idle: timedelta) -> list[m.Checkpoint]:
        """Checkpoints past their TTL, and ephemeral snapshots no sampling client used for ``idle``
        except each open run's newest snapshot (its client is about to use it). A run's current
        in-flight target is never collected (its clients sample it next); its earlier in-flight
        versions are snapshots like the others, so a version a span named stays scorable for ``idle``
        after its last use (docs/async_rl.md)."""
        cutoff = now() - idle
        with self.sessions() as db:
            targets = set(db.scalars(select(m.TrainingRun.inflight_path).where(m.TrainingRun.inflight_path.is_not(None))))
            expired = list(db.scalars(select(m.Checkpoint).where(m.Checkpoint.expires_at.is_not(None),
                                                                 m.Checkpoint.expires_at <= now())))
            snapshots = db.execute(select(m.Checkpoint, m.Session.closed_at)
                                   .join(m.TrainingRun, m.TrainingRun.id == m.Checkpoint.training_run_id)
                                   .join(m.Session, m.Session.id == m.TrainingRun.session_id)
                                   .where(m.Checkpoint.ephemeral.is_(True)).order_by(m.Checkpoint.id)).all()
        newest = {row.training_run_id: row.id for row, closed in snapshots if closed is None and row.inflight_version is None}
        idle_snapshots = [row for row, closed in snapshots
                          if _aware(max(filter(None, (row.created_at, row.last_used_at)), key=_aware)) <= cutoff
                          and newest.get(row.training_run_id) != row.id]
        found = expired + [row for row in idle_snapshots if row.id not in {e.id for e in expired}]
        return [row for row in found if row.path not in targets]


def _aware(value: datetime) -> datetime:
    """SQLite returns naive datetimes (stored as UTC)."""
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def listed(include_temporary: bool):
    """The checkpoints a listing shows: the named ones, and with ``include_temporary`` the temporary
    sampler snapshots too (never in-flight versions: one per async-RL step, collected when idle)."""
    if include_temporary:
        return m.Checkpoint.inflight_version.is_(None)
    return m.Checkpoint.ephemeral.is_(False)
