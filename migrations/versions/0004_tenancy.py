"""tenancy: API keys, per-tenant limits, published / ephemeral / expiring checkpoints

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:40:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

LIMITS = ('max_training_runs', 'max_resident_adapters', 'max_queued_requests', 'train_tokens_per_minute',
          'sample_tokens_per_minute', 'max_storage_bytes')


def upgrade() -> None:
    op.create_table(
        'api_keys',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('tenant_id', sa.Integer(), nullable=False),
        sa.Column('prefix', sa.String(length=16), nullable=False),
        sa.Column('key_sha256', sa.String(length=64), nullable=False),
        sa.Column('label', sa.String(length=128), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('key_sha256'),
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_prefix'), ['prefix'], unique=False)
        batch_op.create_index(batch_op.f('ix_api_keys_tenant_id'), ['tenant_id'], unique=False)
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        for name in LIMITS:
            batch_op.add_column(sa.Column(name, sa.BigInteger(), nullable=True))
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('published', sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.add_column(sa.Column('ephemeral', sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        for name in ('last_used_at', 'expires_at', 'ephemeral', 'published'):
            batch_op.drop_column(name)
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        for name in reversed(LIMITS):
            batch_op.drop_column(name)
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_api_keys_prefix'))
    op.drop_table('api_keys')
