"""Placeholder for issue 33 (revision 0020); the helper assigned to it fills it in and renames the
description. A placeholder nobody fills is removed before landing.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07 00:45:00
"""
from __future__ import annotations

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
