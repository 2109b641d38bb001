"""Tests come in three layers, one folder and one marker each:

    tests/unit    no model, no subprocess services: pure functions, admission with fakes (seconds)
    tests/engine  the tiny model in-process: LoRA layer, trainer engine, losses, sampler backend
    tests/stack   the real processes on loopback, Postgres: end to end, faults, recipes, benchmarks

`pytest tests/unit` (or `-m unit`) runs the first alone.
"""

import os
from pathlib import Path

import pytest

from file_order import DurationRecorder, load_durations, longest_first

pytest_plugins = ["fixtures_postgres", "fixtures_stack"]
# LocalStack forks its services from one warm process per test worker instead of importing torch in each
# (temper/forked_process.py): the suite starts a few hundred of them. Inherited by the scripts tests run.
os.environ.setdefault("TEMPER_LOCALSTACK_FORKSERVER", "1")
# Two test workers on two cores: torch in each worker (and in what it starts) takes one intra-op thread
# unless a test asks for more (two_torch_threads); two each made four OpenMP threads spin on two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
LAYERS = ("unit", "engine", "stack")


def pytest_addoption(parser):
    parser.addoption("--record-file-durations", metavar="PATH", default=None,
                     help="write each test file's total seconds to PATH (tests/file_durations.json orders `make test`)")


def pytest_configure(config):
    path = config.getoption("--record-file-durations")
    if path:
        config.pluginmanager.register(DurationRecorder(Path(path)), "temper-file-durations")


def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = Path(str(item.fspath)).parent.name
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
    longest_first(items, load_durations())
