"""Bounds of the shared validation (common/validation.py) that keep what the scheduler accepts within
what a float32 trainer and a sampler can run: Adam parameters, loss config numbers, top-k targets,
sampling parameters; and error messages that never echo an unbounded input."""

import asyncio

import grpc
import numpy as np
import pytest

from temper.client import convert
from temper.client.types import Datum, ModelInput
from temper.common.codec import encode_tokens
from temper.common.errors import MAX_STATUS_CHARS, AdapterNotLoaded, InvalidArgument, _abort, bounded
from temper.common.validation import (MAX_LOSS_INPUT, MAX_TOPK_TARGETS, check_sample_counts, check_sampling_params,
                                      loss_config_values, validate_adam, validate_forward_backward)
from temper.v1 import types_pb2

TINKER_DEFAULTS = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


@pytest.mark.parametrize("changes", [
    {}, {"learning_rate": 10.0}, {"learning_rate": 0.0}, {"eps": 1e-30}, {"eps": 1.0}, {"weight_decay": 0.1},
    {"learning_rate": 1e-3, "weight_decay": 1000.0}, {"learning_rate": 0.0, "weight_decay": 1e12}, {"grad_clip_norm": 1e9},
])
def test_sane_adam_parameters_pass(changes):
    validate_adam(types_pb2.AdamParams(**{**TINKER_DEFAULTS, **changes}))


@pytest.mark.parametrize("changes, match", [
    ({"learning_rate": 1e38}, "learning_rate"), ({"learning_rate": 1e300}, "learning_rate"),
    ({"learning_rate": 1e30}, "learning_rate"), ({"learning_rate": 10.5}, "learning_rate"),
    ({"learning_rate": -1e-4}, "learning_rate"), ({"eps": 1e-50}, "eps"), ({"eps": 0.0}, "eps"), ({"eps": 1e300}, "eps"),
    ({"learning_rate": 1e-3, "weight_decay": 1e12}, "weight_decay"), ({"weight_decay": -1.0}, "weight_decay"),
    ({"beta1": 1.0}, "beta"), ({"beta2": -0.1}, "beta"), ({"learning_rate": float("nan")}, "finite"),
])
def test_adam_parameters_a_float32_step_cannot_survive_are_refused(changes, match):
    with pytest.raises(InvalidArgument, match=match):
        validate_adam(types_pb2.AdamParams(**{**TINKER_DEFAULTS, **changes}))


def _config(**values):
    return {k: types_pb2.LossConfigValue(number=v) for k, v in values.items()}


@pytest.mark.parametrize("loss_fn, values", [("stable_reinforce", {"kl_coeff": 1e300}), ("dro", {"beta": 1e300}),
                                             ("ppo", {"clip_high_threshold": 1e7}), ("dro", {"beta": -1e30})])
def test_loss_config_numbers_are_bounded(loss_fn, values):
    with pytest.raises(InvalidArgument):
        loss_config_values(loss_fn, _config(**values))


def test_loss_config_numbers_within_the_bound_pass():
    assert loss_config_values("stable_reinforce", _config(kl_coeff=MAX_LOSS_INPUT))["kl_coeff"] == MAX_LOSS_INPUT
    assert loss_config_values("dro", _config(beta=0.0))["beta"] == 0.0


def _datum(n=4, **extra):
    inputs = {"target_tokens": np.arange(1, n + 1, dtype=np.int64), "weights": np.ones(n, np.float32), **extra}
    return convert.datum_to_proto(Datum(model_input=ModelInput.from_ints(list(range(n))), loss_fn_inputs=inputs))


def test_messages_name_at_most_three_of_the_callers_keys_each_cut_short():
    datum = _datum()
    for i in range(250):
        datum.loss_fn_inputs[f"{i:03d}" + "k" * 253].CopyFrom(datum.loss_fn_inputs["weights"])
    with pytest.raises(InvalidArgument, match="unknown loss_fn_inputs") as err:
        validate_forward_backward([datum], "cross_entropy", {}, vocab_size=100)
    assert len(err.value.message) < 400 and "250 in all" in err.value.message
    for bad in ({"x" * 5000: types_pb2.LossConfigValue(number=1.0)},):
        with pytest.raises(InvalidArgument) as err:
            validate_forward_backward([_datum()], "ppo", bad, vocab_size=100)
        assert len(err.value.message) < 400
    with pytest.raises(InvalidArgument) as err:
        validate_forward_backward([_datum()], "l" * 5000, {}, vocab_size=100)
    assert len(err.value.message) < 400


def test_top_k_targets_are_bounded_in_k():
    n = 3
    for k, ok in ((MAX_TOPK_TARGETS, True), (MAX_TOPK_TARGETS + 1, False), (100_000, False)):
        datum = _datum(n)
        datum.loss_fn_inputs["target_tokens"].CopyFrom(convert.datum_to_proto(Datum(
            model_input=ModelInput.from_ints([0]), loss_fn_inputs={"t": np.zeros((n, k), np.int64)})).loss_fn_inputs["t"])
        datum.loss_fn_inputs["weights"].CopyFrom(convert.datum_to_proto(Datum(
            model_input=ModelInput.from_ints([0]), loss_fn_inputs={"w": np.ones((n, k), np.float32)})).loss_fn_inputs["w"])
        if ok:
            validate_forward_backward([datum], "cross_entropy", {}, vocab_size=100)
        else:
            with pytest.raises(InvalidArgument, match="K <= 100"):
                validate_forward_backward([datum], "cross_entropy", {}, vocab_size=100)


@pytest.mark.parametrize("params, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=4, temperature=float("nan")), "temperature"), (dict(max_tokens=4, temperature=1e-45), "temperature"),
    (dict(max_tokens=4, top_p=float("nan")), "top_p"), (dict(max_tokens=4, top_p=1.5), "top_p"),
    (dict(max_tokens=4, stop_strings=["ok", ""]), "stop strings"),
    (dict(max_tokens=4, stop_token_ids=encode_tokens([3, 100])), "stop token ids"),
])
def test_bad_sampling_params_are_refused(params, match):
    with pytest.raises(InvalidArgument, match=match):
        check_sampling_params(types_pb2.SamplingParams(**params), vocab_size=100)


def test_sample_counts_are_bounded():
    check_sample_counts(64, 20, 20, vocab_size=100)
    for args, match in [((0, 0, 0), "num_samples"), ((65, 0, 0), "num_samples"), ((1, -1, 0), "topk_logprobs"),
                        ((1, 101, 0), "topk_logprobs"), ((1, 0, 101), "topk_prompt_logprobs")]:
        with pytest.raises(InvalidArgument, match=match):
            check_sample_counts(*args, vocab_size=100)
    check_sample_counts(128, 0, 0, vocab_size=100, max_num_samples=128)  # a sampler configured for more


class _Context:
    async def abort(self, code, details):
        self.aborted = (code, details)
        raise RuntimeError("aborted")


def test_every_status_message_is_bounded_its_start_kept():
    context = _Context()
    with pytest.raises(RuntimeError):
        asyncio.run(_abort(context, InvalidArgument("x" * 100_000), "/m", None))
    code, details = context.aborted
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) <= MAX_STATUS_CHARS and details.startswith("xxx")
    long_key = AdapterNotLoaded("k" * 5000)
    assert bounded(long_key.message).startswith(AdapterNotLoaded.PREFIX)  # the prefix a client reads stays
    assert bounded("short") == "short"
