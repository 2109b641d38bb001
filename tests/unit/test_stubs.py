"""The checked-in gRPC stubs (protos/temper/v1/*_pb2*.py*) match what the pinned grpcio-tools generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_stubs_are_current():
    proc = subprocess.run(
        [sys.executable, str(REPO / "protos" / "generate.py"), "--check"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n(regenerate with `make stubs` and commit the result)"
