"""Deterministic mode (docs/deterministic.md): training_runs.deterministic (the run's items run with the
batch-invariant primitives; its checkpoints are sampled deterministically) and
sampling_clients.deterministic (the client's samples and logprobs equal the trainer's forward). Rows
made before 0012 are not deterministic.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 21:30:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ('training_runs', 'sampling_clients'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('deterministic', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    for table in ('training_runs', 'sampling_clients'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('deterministic')
