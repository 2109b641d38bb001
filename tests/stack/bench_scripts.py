"""Runs the benchmark scripts for the test_bench_*.py files: the CPU benchmarks still run end to end
(tiny model, one repetition, tiny memory pass) and write every ratio they promise. Their figures are
not checked there: timings belong to benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
