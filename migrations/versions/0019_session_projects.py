"""Placeholder for issue 33 (revision 0019); the helper assigned to it fills it in and renames the
description. A placeholder nobody fills is removed before landing.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07 00:45:00
"""
from __future__ import annotations

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
