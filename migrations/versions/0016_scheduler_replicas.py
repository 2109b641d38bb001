"""Scheduler replicas (issue 32; scheduler/cluster/directory.py): one row per replica process
incarnation, with the address other replicas forward a lane's verbs to and when it was last heard
(by the database's clock). The console's operator page and forwarding read it.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 21:30:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'scheduler_replicas',
        sa.Column('owner', sa.String(length=256), nullable=False),
        sa.Column('address', sa.String(length=256), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('stopped', sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.PrimaryKeyConstraint('owner'),
    )


def downgrade() -> None:
    op.drop_table('scheduler_replicas')
