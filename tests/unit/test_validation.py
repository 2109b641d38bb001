"""Request validation shared by scheduler and trainer (torch-free)."""

import math

import numpy as np
import pytest

from temper.common.codec import encode_array, encode_tokens
from temper.common.errors import InvalidArgument
from temper.common.validation import validate_adam, validate_forward_backward
from temper.v1 import types_pb2


def datum(tokens, targets, weights, t_dtype="int64", w_dtype="float32"):
    return types_pb2.Datum(
        model_input=types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens)))]),
        loss_fn_inputs={"target_tokens": encode_array(np.asarray(targets), t_dtype), "weights": encode_array(np.asarray(weights), w_dtype)},
    )


def test_valid_request_decodes():
    data, config = validate_forward_backward([datum([1, 2, 3], [2, 3, 4], [0, 1, 1])], "cross_entropy", {}, vocab_size=10)
    assert data[0].tokens.tolist() == [1, 2, 3]
    assert data[0].inputs["weights"].dtype == np.float32
    assert config == {}


@pytest.mark.parametrize(
    "data, loss, match",
    [
        ([datum([1, 2], [2, 3], [1, 1])], "mse", "unknown loss_fn"),
        ([], "cross_entropy", "at least one datum"),
        ([datum([], [], [])], "cross_entropy", "empty"),
        ([datum([1, 2], [2, 3], [1, 1], t_dtype="float32")], "cross_entropy", "target_tokens must be int64"),
        ([datum([1, 2], [2, 3], [1, 1], w_dtype="int64")], "cross_entropy", "weights must be float32"),
        ([datum([1, 2], [2, 3, 4], [1, 1])], "cross_entropy", "shape"),
        ([datum([1, 2], [2, 3], [1, 1, 1])], "cross_entropy", "shape"),
        ([datum([1, 10], [2, 3], [1, 1])], "cross_entropy", "outside the vocabulary"),
        ([datum([1, 2], [2, -1], [1, 1])], "cross_entropy", "outside the vocabulary"),
        ([datum([1, 2], [2, 3], [1, math.inf])], "cross_entropy", "NaN or infinite"),
    ],
)
def test_bad_requests_are_invalid_argument(data, loss, match):
    with pytest.raises(InvalidArgument, match=match):
        validate_forward_backward(data, loss, {}, vocab_size=10)


def test_missing_and_unknown_inputs():
    d = datum([1, 2], [2, 3], [1, 1])
    del d.loss_fn_inputs["weights"]
    with pytest.raises(InvalidArgument, match="needs loss_fn_inputs"):
        validate_forward_backward([d], "cross_entropy", {}, vocab_size=10)
    d = datum([1, 2], [2, 3], [1, 1])
    d.loss_fn_inputs["mask"].CopyFrom(encode_array(np.ones(2, np.float32)))
    with pytest.raises(InvalidArgument, match="unknown loss_fn_inputs"):
        validate_forward_backward([d], "cross_entropy", {}, vocab_size=10)


def test_unknown_config_key_and_context_length():
    config = {"clip": types_pb2.LossConfigValue(number=1.0)}
    with pytest.raises(InvalidArgument, match="not used by cross_entropy"):
        validate_forward_backward([datum([1], [2], [1])], "cross_entropy", config, vocab_size=10)
    with pytest.raises(InvalidArgument, match="context length"):
        validate_forward_backward([datum([1, 2, 3], [1, 2, 3], [1, 1, 1])], "cross_entropy", {}, vocab_size=10, max_length=2)


@pytest.mark.parametrize(
    "params, ok",
    [
        (types_pb2.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12), True),
        (types_pb2.AdamParams(learning_rate=-1, eps=1e-8), False),
        (types_pb2.AdamParams(learning_rate=1e-4), False),  # eps 0: zero gradients would become NaN
        (types_pb2.AdamParams(learning_rate=1e-4, beta1=1.0, eps=1e-8), False),
        (types_pb2.AdamParams(learning_rate=math.nan), False),
        (types_pb2.AdamParams(learning_rate=1e-4, grad_clip_norm=-1, eps=1e-8), False),
        (types_pb2.AdamParams(learning_rate=1e-4, weight_decay=-0.1, eps=1e-8), False),
    ],
)
def test_adam_params(params, ok):
    if ok:
        validate_adam(params)
    else:
        with pytest.raises(InvalidArgument):
            validate_adam(params)
