"""A run's "dispatched" watermark (issue 32, less work per verb): training_runs.dispatched_seq, the
highest seq of the run sent (or about to be sent) to its trainer. It replaces the per-request
"running" marks: a request row still "queued" whose seq is at or below its run's watermark is read
as "running" (may have been applied). One run row updated per cycle instead of one request row per
verb. Rows already "running" keep their status and meaning.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 22:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('training_runs', sa.Column('dispatched_seq', sa.BigInteger(), nullable=False, server_default='0'))


def downgrade() -> None:
    # the watermark's meaning goes back into the rows: queued at or below it is running
    op.execute("UPDATE requests AS r SET status = 'running' FROM training_runs AS t "
               "WHERE t.id = r.training_run_id AND r.status = 'queued' AND r.seq_id <= t.dispatched_seq")
    op.drop_column('training_runs', 'dispatched_seq')
