"""Lane leases (issue 32; scheduler/cluster/): lane_leases holds, per trainer lane, the scheduler
replica that owns it, its fencing token and when the lease expires by the database's clock.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-20 10:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'lane_leases',
        sa.Column('lane', sa.String(length=256), nullable=False),
        sa.Column('owner', sa.String(length=256), nullable=False),
        sa.Column('token', sa.BigInteger(), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('renewed_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('lane'),
    )


def downgrade() -> None:
    op.drop_table('lane_leases')
