"""audit_log and api_keys.is_admin (issue 22).

audit_log: who (the acting key's prefix and tenant, or the admin command), what and when, for key
create/revoke, limit changes, publish/unpublish, TTL changes, deletes, imports and session open/close;
written in the transaction of the change itself (scheduler/db/audit.py). Append-only: triggers make
the database refuse UPDATE and DELETE on it (and TRUNCATE on PostgreSQL), whoever asks.
api_keys.is_admin: an operator's key (create-key --admin), false for every key made before.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 18:50:00
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

REFUSAL = 'audit_log is append-only'
POSTGRES_TRIGGERS = [
    f"""CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION '{REFUSAL}'; END $$""",
    """CREATE TRIGGER audit_log_no_change BEFORE UPDATE OR DELETE ON audit_log
        FOR EACH ROW EXECUTE FUNCTION audit_log_append_only()""",
    """CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
        FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only()""",
]
SQLITE_TRIGGERS = [
    f"CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log BEGIN SELECT RAISE(ABORT, '{REFUSAL}'); END",
    f"CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log BEGIN SELECT RAISE(ABORT, '{REFUSAL}'); END",
]


def upgrade() -> None:
    op.create_table(
        'audit_log',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('tenant', sa.String(length=128), nullable=False),
        sa.Column('key_prefix', sa.String(length=16), nullable=False),
        sa.Column('actor', sa.String(length=16), nullable=False),
        sa.Column('action', sa.String(length=32), nullable=False),
        sa.Column('target', sa.String(length=512), nullable=False),
        sa.Column('details', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index(op.f('ix_audit_log_at'), 'audit_log', ['at'], unique=False)
    op.create_index(op.f('ix_audit_log_tenant'), 'audit_log', ['tenant'], unique=False)
    op.create_index(op.f('ix_audit_log_action'), 'audit_log', ['action'], unique=False)
    for statement in POSTGRES_TRIGGERS if op.get_bind().dialect.name == 'postgresql' else SQLITE_TRIGGERS:
        op.execute(statement)
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('is_admin', sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('is_admin')
    op.drop_index(op.f('ix_audit_log_action'), table_name='audit_log')
    op.drop_index(op.f('ix_audit_log_tenant'), table_name='audit_log')
    op.drop_index(op.f('ix_audit_log_at'), table_name='audit_log')
    op.drop_table('audit_log')  # its triggers go with it
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('DROP FUNCTION audit_log_append_only()')
