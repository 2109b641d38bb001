"""run_metrics and sampling_records: what the scheduler keeps after a request is answered (issue 22).

run_metrics: one row per answered sequenced request of a training run (loss, tokens, grad norm,
learning rate, the answer's metrics, time queued and on the trainer, how many other runs shared its
cycle), keyed by (run, seq), written in the transaction that records the request's outcome.
sampling_records: one row per answered Sample / ComputeLogprobs (prompt tokens prefilled, tokens
sampled, start and answer times), by session and start time. Times are unix milliseconds. Both are
pruned by the scheduler (metrics_retention_seconds, metrics_max_rows_per_run).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 18:40:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_metrics',
        sa.Column('training_run_id', sa.String(length=128), nullable=False),
        sa.Column('seq_id', sa.BigInteger(), nullable=False),
        sa.Column('step', sa.BigInteger(), nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('loss', sa.Float(), nullable=True),
        sa.Column('num_tokens', sa.BigInteger(), nullable=False),
        sa.Column('grad_norm', sa.Float(), nullable=True),
        sa.Column('learning_rate', sa.Float(), nullable=True),
        sa.Column('metrics', sa.JSON(), nullable=False),
        sa.Column('queued_seconds', sa.Float(), nullable=False),
        sa.Column('trainer_seconds', sa.Float(), nullable=False),
        sa.Column('cobatched_with', sa.Integer(), nullable=False),
        sa.Column('trainer', sa.String(length=256), nullable=False),
        sa.Column('cycle', sa.BigInteger(), nullable=False),
        sa.Column('created_ms', sa.BigInteger(), nullable=False),
        sa.Column('started_ms', sa.BigInteger(), nullable=False),
        sa.Column('answered_ms', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['training_run_id'], ['training_runs.id']),
        sa.PrimaryKeyConstraint('training_run_id', 'seq_id'),
    )
    with op.batch_alter_table('run_metrics', schema=None) as batch_op:
        batch_op.create_index('ix_run_metrics_run_step', ['training_run_id', 'step'], unique=False)
        batch_op.create_index(batch_op.f('ix_run_metrics_answered_ms'), ['answered_ms'], unique=False)
    op.create_table(
        'sampling_records',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('session_id', sa.String(length=64), nullable=False),
        sa.Column('sampler_id', sa.String(length=128), nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('num_samples', sa.Integer(), nullable=False),
        sa.Column('prompt_tokens', sa.BigInteger(), nullable=False),
        sa.Column('tokens_sampled', sa.BigInteger(), nullable=False),
        sa.Column('started_ms', sa.BigInteger(), nullable=False),
        sa.Column('answered_ms', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['session_id'], ['sessions.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('sampling_records', schema=None) as batch_op:
        batch_op.create_index('ix_sampling_records_session_started', ['session_id', 'started_ms'], unique=False)
        batch_op.create_index(batch_op.f('ix_sampling_records_started_ms'), ['started_ms'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('sampling_records', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sampling_records_started_ms'))
        batch_op.drop_index('ix_sampling_records_session_started')
    op.drop_table('sampling_records')
    with op.batch_alter_table('run_metrics', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_metrics_answered_ms'))
        batch_op.drop_index('ix_run_metrics_run_step')
    op.drop_table('run_metrics')
