"""Signing keys (issue 33): secrets that sign short-lived tokens (JWTs for the Tinker SDK's auth
exchange, signed download URLs), shared by all scheduler replicas and rotated by age
(scheduler/db/signing_keys.py). (purpose, generation) is unique: replicas rotating at once make one key.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 00:45:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'signing_keys',
        sa.Column('kid', sa.String(length=64), nullable=False),
        sa.Column('purpose', sa.String(length=32), nullable=False),
        sa.Column('generation', sa.BigInteger(), nullable=False),
        sa.Column('secret', sa.LargeBinary(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('kid'),
        sa.UniqueConstraint('purpose', 'generation', name='uq_signing_keys_purpose_generation'),
    )


def downgrade() -> None:
    op.drop_table('signing_keys')
