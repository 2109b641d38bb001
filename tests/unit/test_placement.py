"""Run placement over trainers (scheduler/workers/backends.py): by load at creation, then fixed per run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fakes_scheduler import settings
from temper.common.errors import NotFound, Unavailable
from temper.scheduler.workers.backends import Backends


def trainer(address: str, model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(address=address, info=SimpleNamespace(base_model=model))


def backends_with(*trainers) -> Backends:
    backends = Backends(settings())
    backends.trainers = list(trainers)
    return backends


def test_new_runs_go_to_the_least_loaded_trainer_of_their_model_and_stay_there():
    backends = backends_with(trainer("a:1"), trainer("b:1"), trainer("c:1", model="other"))
    placed = []
    for i in range(4):
        chosen = backends.place("m")
        backends.remember_placement(f"r{i}", chosen.address)
        placed.append(chosen.address)
    assert sorted(placed) == ["a:1", "a:1", "b:1", "b:1"]  # spread, and never onto another model's trainer
    backends.trainers.append(trainer("d:1"))  # a trainer joins: the placed runs do not move
    assert [backends.trainer_for("m", f"r{i}").address for i in range(4)] == placed
    assert backends.place("m").address == "d:1"


def test_a_run_whose_trainer_is_gone_is_unavailable_not_moved():
    backends = backends_with(trainer("a:1"), trainer("b:1"))
    backends.remember_placement("r", "b:1")
    backends.trainers.pop()
    with pytest.raises(Unavailable, match="b:1"):
        backends.trainer_for("m", "r")


def test_runs_from_before_placements_hash_and_unknown_models_are_not_found():
    backends = backends_with(trainer("a:1"), trainer("b:1"))
    assert backends.trainer_for("m", "old-run") is backends.trainer_for("m", "old-run")
    with pytest.raises(NotFound):
        backends.place("nope")
