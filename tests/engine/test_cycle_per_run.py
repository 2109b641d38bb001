"""Runs fail alone in a trainer cycle: a run the engine refuses (unknown adapter, bad item, a loss
that is not finite) gets its error per item and keeps its state, and the other runs of the cycle
compute exactly what they compute without it."""

import numpy as np
import torch

from test_trainer_engine import SPEC, adapter_state, assert_same_state, datum, fb, random_data, run_wire, sft
from temper.common.errors import InvalidArgument, NotFound
from temper.services.models.loading import load_model
from temper.services.trainer import convert
from temper.services.trainer.engine import AdamParams, OptimStepItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2

ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def make_engine(model_dir, folder, runs=("run-a",)):
    engine = TrainerEngine(load_model(model_dir), TrainerSettings(checkpoint_dir=folder / "ckpt", logprob_chunk_tokens=5,
                                                                  max_tokens_per_microbatch=24))
    for seed, run_id in enumerate(runs, start=3):
        engine.create_adapter(run_id, SPEC, seed=seed)
    return engine


def long_data(seed):
    """Datums of 13+ tokens: with 24 tokens per micro-batch every row is a pass of its own, so the
    rows of another run in the cycle change nothing of this run's arithmetic."""
    rng = np.random.default_rng(seed)
    return [sft(rng.integers(0, 512, n).tolist(), rng.standard_normal(n - 1).astype(np.float32)) for n in (14, 16)]


def assert_same_results(got, want):
    assert got.metrics == want.metrics
    for a, b in [*zip(got.logprobs, want.logprobs), *zip(got.elementwise_loss, want.elementwise_loss)]:
        np.testing.assert_array_equal(a, b)


def assert_same_weights(engine_a, engine_b, run_id):
    a, b = engine_a.host.get(run_id), engine_b.host.get(run_id)
    for name in a.params:
        torch.testing.assert_close(a.params[name].detach(), b.params[name].detach(), atol=1e-6, rtol=0)


def test_an_unknown_runs_items_fail_alone_and_the_valid_run_computes_what_it_computes_alone(tiny_model_dir, tmp_path):
    mixed, alone = make_engine(tiny_model_dir, tmp_path / "mixed"), make_engine(tiny_model_dir, tmp_path / "alone")
    data = [sft(t, w) for t, w in random_data(3, seed=11)]
    results, steps = mixed.run_cycle([fb("run-a", data, seq_id=1), fb("missing", data, seq_id=1)],
                                     [OptimStepItem("run-a", ADAM, seq_id=2), OptimStepItem("missing", ADAM, seq_id=2)])
    (want,), (want_step,) = alone.run_cycle([fb("run-a", data, seq_id=1)], [OptimStepItem("run-a", ADAM, seq_id=2)])
    assert_same_results(results[0], want)
    assert steps[0] == want_step
    assert_same_weights(mixed, alone, "run-a")
    for refused in (results[1], steps[1]):
        assert isinstance(refused, NotFound) and "the adapter of run missing is not loaded" in refused.message
    # on the wire: the unknown run's items carry NOT_FOUND and its message; the valid run's, its answers
    response = convert.cycle_to_pb(results, steps)
    assert [s.code for s in response.forward_backward_status] == [0, 5] and [s.code for s in response.optim_step_status] == [0, 5]
    assert response.forward_backward_status[1].message == results[1].message
    assert dict(response.forward_backward[0].metrics) == want.metrics and dict(response.optim_step[0].metrics) == want_step
    # a later cycle of the valid run goes on from its applied seqs, like the twin's
    more = [sft(t, w) for t, w in random_data(2, seed=12)]
    (again,), _ = mixed.run_cycle([fb("run-a", more, seq_id=3)], [])
    (twin,), _ = alone.run_cycle([fb("run-a", more, seq_id=3)], [])
    assert_same_results(again, twin)


def test_a_run_whose_loss_is_not_finite_fails_alone_and_keeps_its_state(tiny_model_dir, tmp_path):
    mixed = make_engine(tiny_model_dir, tmp_path / "mixed", runs=("run-a", "run-b"))
    alone = make_engine(tiny_model_dir, tmp_path / "alone", runs=("run-a", "run-b"))
    warm_up = [fb("run-b", [sft([1, 2, 3, 4], [1, 1, 1])], seq_id=1)]
    for engine in (mixed, alone):
        engine.run_cycle(warm_up, [OptimStepItem("run-b", ADAM, seq_id=2)])  # run-b has Adam state and pending nothing
        engine.run_cycle([fb("run-b", [sft([4, 3, 2, 1], [1, 1, 1])], seq_id=3)], [])  # and pending gradients
    before = adapter_state(mixed, "run-b")
    good = fb("run-a", long_data(13), seq_id=1)
    # bypasses the wire checks (which bound loss inputs to |x| <= 1e6): float32 overflows to inf
    overflowing = fb("run-b", [sft([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [3e38] * 13)], seq_id=4)
    results, steps = mixed.run_cycle([good, overflowing], [OptimStepItem("run-a", ADAM, seq_id=2), OptimStepItem("run-b", ADAM, seq_id=5)])
    (want,), (want_step,) = alone.run_cycle([good], [OptimStepItem("run-a", ADAM, seq_id=2)])
    for refused in (results[1], steps[1]):
        assert isinstance(refused, InvalidArgument) and "run run-b is not finite" in refused.message
    assert_same_state(adapter_state(mixed, "run-b"), before)  # weights, pending grads, Adam state, steps
    assert mixed.host.get("run-b").applied_seq == 3 and mixed.host.get("run-b").pending_tokens == 3
    for got, expected in zip(results[0].logprobs, want.logprobs):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    assert abs(results[0].metrics["loss:sum"] - want.metrics["loss:sum"]) <= 1e-6 * max(1.0, abs(want.metrics["loss:sum"]))
    assert abs(steps[0]["grad_norm:mean"] - want_step["grad_norm:mean"]) <= 1e-6 * max(1.0, want_step["grad_norm:mean"])
    assert_same_weights(mixed, alone, "run-a")
    # the refused seqs were not applied: the run goes on with finite input
    _, (step,) = mixed.run_cycle([fb("run-b", [sft([5, 6, 7, 8], [1, 1, 1])], seq_id=4)], [OptimStepItem("run-b", ADAM, seq_id=5)])
    assert np.isfinite(step["grad_norm:mean"]) and all(bool(torch.isfinite(p).all()) for p in mixed.host.get("run-b").params.values())


def test_a_bad_item_on_the_wire_refuses_its_run_and_no_other(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path, runs=("run-a", "run-b"))
    before = adapter_state(engine, "run-b")
    good = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([5, 6, 7, 8], [1, 1, 1])], loss_fn="cross_entropy", seq_id=1)
    fine = trainer_pb2.ForwardBackwardItem(training_run_id="run-b", data=[datum([5, 6, 7, 8], [1, 1, 1])], loss_fn="cross_entropy", seq_id=1)
    bad = trainer_pb2.ForwardBackwardItem(training_run_id="run-b", data=[datum([1, 2, 9999], [1, 1])], loss_fn="cross_entropy", seq_id=2)
    results, _ = run_wire(engine, [good, fine, bad])
    assert results[0].metrics["num_tokens:sum"] == 3 and engine.host.get("run-a").applied_seq == 1
    for refused in results[1:]:
        assert isinstance(refused, InvalidArgument) and "outside the vocabulary" in refused.message
    assert_same_state(adapter_state(engine, "run-b"), before)
    assert engine.host.get("run-b").applied_seq == 0
