"""checkpoints.user_metadata: the metadata a save was given (SaveWeightsRequest.user_metadata)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-09 09:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('user_metadata', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('user_metadata')
