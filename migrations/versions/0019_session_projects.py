"""Session display names, projects and expiry (issue 33, items 1 and 3): ``projects`` (a tenant's
named groups of sessions, ``scheduler/db/projects.py``), ``sessions.display_name`` (the SDK's
``ServiceClient(display_name=...)``) and ``sessions.project_id`` (``ServiceClient(project_id=...)`` or
``assign_session_project``). An expired session is a closed one with close_status ``expired``: no
column of its own. The index on (closed_at, last_heartbeat_at) serves the expiry sweep.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07 00:45:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'projects',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('tenant_id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=256), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('tenant_id', 'name', name='uq_projects_tenant_name'),
    )
    with op.batch_alter_table('sessions') as batch:
        batch.add_column(sa.Column('display_name', sa.String(length=256), nullable=True))
        batch.add_column(sa.Column('project_id', sa.String(length=64), nullable=True))
        batch.create_foreign_key('fk_sessions_project_id', 'projects', ['project_id'], ['id'])
    op.create_index('ix_sessions_project_id', 'sessions', ['project_id'])
    op.create_index('ix_sessions_open_heartbeat', 'sessions', ['closed_at', 'last_heartbeat_at'])


def downgrade() -> None:
    op.drop_index('ix_sessions_open_heartbeat', table_name='sessions')
    op.drop_index('ix_sessions_project_id', table_name='sessions')
    with op.batch_alter_table('sessions') as batch:
        batch.drop_constraint('fk_sessions_project_id', type_='foreignkey')
        batch.drop_column('project_id')
        batch.drop_column('display_name')
    op.drop_table('projects')
