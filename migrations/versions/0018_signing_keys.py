"""Placeholder for issue 33 (revision 0018); the helper assigned to it fills it in and renames the
description. A placeholder nobody fills is removed before landing.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 00:45:00
"""
from __future__ import annotations

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
