"""Tests come in three layers, one folder and one marker each:

    tests/unit    no model, no subprocess services: pure functions, admission with fakes (seconds)
    tests/engine  the tiny model in-process: LoRA layer, trainer engine, losses, sampler backend
    tests/stack   the real processes on loopback, Postgres: end to end, faults, recipes, benchmarks

`pytest tests/unit` (or `-m unit`) runs the first alone.
"""

from pathlib import Path

import pytest

pytest_plugins = ["fixtures_postgres", "fixtures_stack"]
LAYERS = ("unit", "engine", "stack")


def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = Path(str(item.fspath)).parent.name
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
