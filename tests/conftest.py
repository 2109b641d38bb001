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
    # Longest first: `make test` hands whole files to two workers in collection order (--dist loadfile).
    # A long file that starts last runs alone while the other worker idles, so the files marked slow
    # go first, then the stack, the engine, and the unit tests (seconds each) fill the gaps at the end.
    # The sort is stable: each file's own order is kept.
    slow_files = {item.fspath for item in items if item.get_closest_marker("slow")}
    order = {"stack": 1, "engine": 2, "unit": 3}
    items.sort(key=lambda item: 0 if item.fspath in slow_files else order.get(Path(str(item.fspath)).parent.name, 4))
