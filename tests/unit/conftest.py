"""Snapshot keys carry a random token per attempt (scheduler/planning/recovery.snapshot_key); the unit
tests that name the keys they expect see the token ``t``. test_recovery checks the real keys differ."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def fixed_snapshot_token(request, monkeypatch):
    if request.node.get_closest_marker("real_snapshot_tokens") is None:
        monkeypatch.setattr("temper.scheduler.planning.recovery.attempt_token", lambda: "t")
