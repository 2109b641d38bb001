"""The tenants' uploaded images (UploadImage; issue 30): content-addressed per tenant, their bytes in
the ``images`` table, their sizes counted in the tenant's storage with its checkpoints.

A mixin of ``Store`` (same engine, same one-transaction-per-method rule). Another tenant's image is
never found: a lookup is always by (tenant, sha256), so a caller cannot learn that someone else
uploaded the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from temper.common.errors import NotFound
from temper.scheduler.db import models as m
from temper.scheduler.db.audit import Actor, record
from temper.scheduler.db.outage import database_errors

IMAGE_COLUMNS = (m.ImageAsset.id, m.ImageAsset.sha256, m.ImageAsset.format, m.ImageAsset.width, m.ImageAsset.height,
                 m.ImageAsset.size_bytes, m.ImageAsset.created_at)


@dataclass(frozen=True)
class StoredImage:
    """An image row without its bytes (listing, the upload's answer)."""

    sha256: str
    format: str
    width: int
    height: int
    size_bytes: int
    created_at: object  # datetime


@dataclass(frozen=True)
class NewImage:
    sha256: str
    format: str
    width: int
    height: int
    data: bytes


def _stored(row) -> StoredImage:
    return StoredImage(row.sha256, row.format, row.width, row.height, row.size_bytes, row.created_at)


@database_errors
class ImageStore:
    sessions = None  # sessionmaker, set by Store

    def find_image(self, tenant: str, sha256: str) -> StoredImage | None:
        """The tenant's image with these bytes (None: it has none)."""
        with self.sessions() as db:
            row = db.execute(select(*IMAGE_COLUMNS).join(m.Tenant, m.Tenant.id == m.ImageAsset.tenant_id)
                             .where(m.Tenant.name == tenant, m.ImageAsset.sha256 == sha256)).first()
        return _stored(row) if row is not None else None

    def add_image(self, tenant: str, image: NewImage, actor: Actor | None = None) -> tuple[StoredImage, bool]:
        """The tenant's image of these bytes, added unless it had it: (row, whether it was added).
        Two uploads of the same bytes at once make one row (the unique constraint; the loser reads it)."""
        tenant_id = self.ensure_tenant(tenant)
        try:
            with self.sessions.begin() as db:
                row = m.ImageAsset(tenant_id=tenant_id, sha256=image.sha256, format=image.format, width=image.width,
                                   height=image.height, size_bytes=len(image.data), data=image.data)
                db.add(row)
                db.flush()
                record(db, actor, "image.upload", tenant, f"temper-image://{image.sha256}", size_bytes=len(image.data))
                return _stored(row), True
        except IntegrityError:
            existing = self.find_image(tenant, image.sha256)
            if existing is None:
                raise
            return existing, False

    def image_data(self, tenant: str, sha256s: list[str]) -> dict[str, tuple[str, bytes]]:
        """sha256 -> (format, bytes) of those of ``sha256s`` the tenant uploaded (others are left out)."""
        if not sha256s:
            return {}
        with self.sessions() as db:
            rows = db.execute(select(m.ImageAsset.sha256, m.ImageAsset.format, m.ImageAsset.data)
                              .join(m.Tenant, m.Tenant.id == m.ImageAsset.tenant_id)
                              .where(m.Tenant.name == tenant, m.ImageAsset.sha256.in_(sorted(set(sha256s))))).all()
        return {row.sha256: (row.format, bytes(row.data)) for row in rows}

    def list_images(self, tenant: str, limit: int, offset: int) -> tuple[list[StoredImage], int]:
        """A page of the tenant's images, newest first, and how many it has."""
        with self.sessions() as db:
            where = (m.Tenant.name == tenant,)
            rows = db.execute(select(*IMAGE_COLUMNS).join(m.Tenant, m.Tenant.id == m.ImageAsset.tenant_id).where(*where)
                              .order_by(m.ImageAsset.id.desc()).limit(limit).offset(offset)).all()
            total = db.scalar(select(func.count(m.ImageAsset.id)).join(m.Tenant, m.Tenant.id == m.ImageAsset.tenant_id)
                              .where(*where)) or 0
        return [_stored(row) for row in rows], int(total)

    def delete_image(self, tenant: str, sha256: str, actor: Actor | None = None) -> int:
        """Deletes the tenant's image; its bytes freed. NotFound when the tenant has none of that sha256."""
        with self.sessions.begin() as db:
            row = db.scalar(select(m.ImageAsset).join(m.Tenant, m.Tenant.id == m.ImageAsset.tenant_id)
                            .where(m.Tenant.name == tenant, m.ImageAsset.sha256 == sha256))
            if row is None:
                raise NotFound(f"image temper-image://{sha256} not found")
            freed = row.size_bytes
            record(db, actor, "image.delete", tenant, f"temper-image://{sha256}", size_bytes=freed)
            db.delete(row)
        return freed

    def image_bytes(self, tenant: str) -> int:
        """Bytes of the tenant's uploaded images (part of its storage)."""
        with self.sessions() as db:
            return int(db.scalar(select(func.coalesce(func.sum(m.ImageAsset.size_bytes), 0)).select_from(m.ImageAsset)
                                 .join(m.Tenant, m.Tenant.id == m.ImageAsset.tenant_id).where(m.Tenant.name == tenant)) or 0)
