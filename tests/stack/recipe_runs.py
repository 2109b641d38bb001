"""Runs the recipes (recipes/rl_arithmetic.py, dpo.py, distill.py) for test_recipes_rl.py and
test_recipes_dpo_distill.py: a couple of steps each on the tiny model, through the client against a
real local stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def run_recipe(name: str, tiny_model_dir: str, tmp_path: Path, *extra: str, api_key: str | None = None) -> tuple[dict, Path]:
    out = tmp_path / f"out-{name}"
    env = {**os.environ, "TEMPER_API_KEY": api_key} if api_key else None
    proc = subprocess.run(
        [sys.executable, "-m", f"recipes.{name}", "--base-model", tiny_model_dir, "--steps", "2", "--threads", "1",
         "--out-dir", str(out), "--data-dir", str(tmp_path / f"data-{name}"), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["recipe"] == name and summary["steps"] == 2 and summary["seconds"] > 0
    assert (out / "summary.json").is_file()
    return summary, out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG
