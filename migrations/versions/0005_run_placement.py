"""training_runs.trainer: the trainer a run is placed on (by load, at creation), kept across restarts

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 11:30:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('trainer', sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_column('trainer')
