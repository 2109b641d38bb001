"""training_runs.lora_expert_rank: the routed experts' LoRA rank in effect of a run on a
mixture-of-experts model (the trainer's CreateAdapterResponse.expert_rank); 0: no expert LoRA (a
dense model, no train_mlp, or a run made before 0009, none of which adapt routed experts). Stored
so that the run's info shows it and a rebuilt adapter (scheduler/recovery.py) has the same shape.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-12 09:00:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lora_expert_rank', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_column('lora_expert_rank')
