"""A run's unexpected failure in a trainer cycle is its own: an optim step that raises or would make
weights not finite, or a pass that raises for one run, fails that run's item alone, with nothing of
the run changed, while the other runs' items compute what they compute without it. Also: the
checks on an imported adapter's config echo none of its values."""

import json

import grpc
import numpy as np
import pytest
import torch

from test_cycle_per_run import ADAM, assert_same_results, assert_same_weights, long_data, make_engine
from test_trainer_engine import adapter_state, assert_same_state, fb, sft
from temper.common.errors import InvalidArgument
from temper.services.trainer import losses
from temper.services.trainer.engine import AdamParams, OptimStepItem
from temper.services.trainer.imports import read_config


def test_an_optim_step_that_raises_fails_alone_and_changes_nothing(tiny_model_dir, tmp_path):
    mixed = make_engine(tiny_model_dir, tmp_path / "mixed", runs=("run-a", "run-b"))
    alone = make_engine(tiny_model_dir, tmp_path / "alone", runs=("run-a", "run-b"))
    for engine in (mixed, alone):  # both runs with Adam state, then pending gradients
        engine.run_cycle([fb("run-a", long_data(1), seq_id=1), fb("run-b", long_data(2), seq_id=1)],
                         [OptimStepItem("run-a", ADAM, seq_id=2), OptimStepItem("run-b", ADAM, seq_id=2)])
        engine.run_cycle([fb("run-a", long_data(3), seq_id=3), fb("run-b", long_data(4), seq_id=3)], [])
    before = adapter_state(mixed, "run-b")
    # past validation's bounds (the engine takes domain objects): torch raises mid-step, after it
    # has moved the Adam moments; with clipping on, the gradients were scaled too
    for seq, overflowing in enumerate((AdamParams(learning_rate=1e38, eps=1e-8),
                                       AdamParams(learning_rate=1e38, eps=1e-8, grad_clip_norm=1e-3)), start=4):
        _, steps = mixed.run_cycle([], [OptimStepItem("run-a", ADAM, seq_id=seq), OptimStepItem("run-b", overflowing, seq_id=4)])
        _, (want,) = alone.run_cycle([], [OptimStepItem("run-a", ADAM, seq_id=seq)])
        assert steps[0] == want
        assert steps[1].code == grpc.StatusCode.INTERNAL and "optim step of run run-b failed" in steps[1].message
        assert_same_state(adapter_state(mixed, "run-b"), before)  # weights, pending grads, Adam state, steps
        assert mixed.host.get("run-b").applied_seq == 3 and mixed.host.get("run-b").optimizer.param_groups[0]["lr"] == ADAM.learning_rate
        assert_same_weights(mixed, alone, "run-a")
    # the refused seq was not applied: a sane step of it goes on as the twin's
    _, (got,) = mixed.run_cycle([], [OptimStepItem("run-b", ADAM, seq_id=4)])
    _, (want,) = alone.run_cycle([], [OptimStepItem("run-b", ADAM, seq_id=4)])
    assert got == want
    assert_same_weights(mixed, alone, "run-b")


def test_a_step_that_would_make_weights_not_finite_is_undone(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path, runs=("run-a",))
    engine.run_cycle([fb("run-a", long_data(5), seq_id=1)], [])
    before = adapter_state(engine, "run-a")
    # eps 1e-50 is 0 in float32: a fresh LoRA's A (zero gradient, B = 0) becomes 0 / 0
    _, (step,) = engine.run_cycle([], [OptimStepItem("run-a", AdamParams(learning_rate=1e-4, eps=1e-50), seq_id=2)])
    assert isinstance(step, InvalidArgument) and "not finite" in step.message
    assert_same_state(adapter_state(engine, "run-a"), before)
    assert not engine.host.get("run-a").optimizer.state  # it had none before the step
    _, (step,) = engine.run_cycle([], [OptimStepItem("run-a", ADAM, seq_id=2)])
    assert np.isfinite(step["grad_norm:mean"])
    assert all(bool(torch.isfinite(p).all()) for p in engine.host.get("run-a").params.values())


def _boom(lp, inputs, config):
    raise RuntimeError("a bug in one run's loss")


def test_a_pass_that_raises_for_one_run_fails_that_run_alone(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(losses.LOSS_FNS, "boom", _boom)
    mixed = make_engine(tiny_model_dir, tmp_path / "mixed", runs=("run-a", "run-b"))
    alone = make_engine(tiny_model_dir, tmp_path / "alone", runs=("run-a", "run-b"))
    for engine in (mixed, alone):
        engine.run_cycle([fb("run-b", [sft([4, 3, 2, 1], [1, 1, 1])], seq_id=1)], [])  # pending gradients
    before = adapter_state(mixed, "run-b")
    good = fb("run-a", long_data(7), seq_id=1)
    results, steps = mixed.run_cycle([good, fb("run-b", long_data(8), loss_fn="boom", seq_id=2)],
                                     [OptimStepItem("run-a", ADAM, seq_id=2), OptimStepItem("run-b", ADAM, seq_id=3)])
    (want,), (want_step,) = alone.run_cycle([good], [OptimStepItem("run-a", ADAM, seq_id=2)])
    assert_same_results(results[0], want)
    assert steps[0] == want_step
    for failed in (results[1], steps[1]):
        assert failed.code == grpc.StatusCode.INTERNAL and "pass of run run-b failed (RuntimeError)" in failed.message
    assert_same_state(adapter_state(mixed, "run-b"), before)
    assert mixed.host.get("run-b").applied_seq == 1
    assert_same_weights(mixed, alone, "run-a")
    # a failure of every run is no one run's: the cycle raises, every gradient undone
    with pytest.raises(RuntimeError):
        mixed.run_cycle([fb("run-a", long_data(9), loss_fn="boom", seq_id=3), fb("run-b", long_data(9), loss_fn="boom", seq_id=2)], [])
    assert_same_state(adapter_state(mixed, "run-b"), before)


CONFIG = {"base_model_name_or_path": "tiny", "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


@pytest.mark.parametrize("data", [
    b"[" * 60_000,                                                          # nested too deep to parse
    json.dumps({**CONFIG, "peft_type": "X" * 60_000}).encode(),
    json.dumps({**CONFIG, "base_model_name_or_path": "m" * 60_000}).encode(),
    json.dumps({**CONFIG, "use_dora": "d" * 60_000}).encode(),
    json.dumps({**CONFIG, "r": "r" * 60_000}).encode(),
    json.dumps({**CONFIG, "target_modules": ["t" * 1000] * 50}).encode(),
])
def test_an_imported_config_is_refused_without_echoing_it(data):
    with pytest.raises(InvalidArgument) as err:
        read_config(data, "tiny", {"q_proj", "k_proj"})
    assert len(err.value.message) < 400
