"""In-flight weights (docs/async_rl.md; issue 31): a training run's in-flight target
(training_runs.inflight_version, 0 before any in-flight save, and inflight_path, the current target's
checkpoint), each in-flight checkpoint's version (checkpoints.inflight_version; NULL for every other
checkpoint), and what an in-flight sampling client follows (sampling_clients.inflight_run_id) from
which version on (sampling_clients.min_version).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-12 10:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('inflight_version', sa.BigInteger(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('inflight_path', sa.String(length=512), nullable=True))
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('inflight_version', sa.BigInteger(), nullable=True))
    with op.batch_alter_table('sampling_clients', schema=None) as batch_op:
        batch_op.add_column(sa.Column('inflight_run_id', sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column('min_version', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sampling_clients', schema=None) as batch_op:
        batch_op.drop_column('min_version')
        batch_op.drop_column('inflight_run_id')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('inflight_version')
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_column('inflight_path')
        batch_op.drop_column('inflight_version')
