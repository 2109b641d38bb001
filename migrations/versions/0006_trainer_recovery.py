"""Trainer recovery: requests.payload (the logged request, replayed onto a restored adapter) and
training_runs.snapshot_key / snapshot_seq (the run's latest adapter snapshot)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 09:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('payload', sa.LargeBinary(), nullable=True))
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('snapshot_key', sa.String(length=512), nullable=True))
        batch_op.add_column(sa.Column('snapshot_seq', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_column('snapshot_seq')
        batch_op.drop_column('snapshot_key')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('payload')
