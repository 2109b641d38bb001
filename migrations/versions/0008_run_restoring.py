"""training_runs.restoring: a restore of the run's adapter is under way (scheduler/recovery.py); set
before the snapshot or fresh adapter goes to the trainer and cleared after the replay, so a scheduler
that dies in between leaves a mark its successor acts on (the adapter there may be half-built)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-10 09:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('restoring', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_column('restoring')
