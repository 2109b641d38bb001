"""requests.result: the serialized answer of a completed request, for retries after a restart

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 04:25:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('result', sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('result')
