import numpy as np
import pytest
import torch

from temper.common import codec
from temper.common.errors import InvalidArgument
from temper.v1 import types_pb2


@pytest.mark.parametrize("dtype", ["float32", "int64", "int32", "float16"])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 3, 5)])
def test_numpy_round_trip(dtype, shape):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal(shape) * 100).astype(dtype)
    message = codec.encode_array(arr, dtype)
    assert message.dtype == codec.NAME_TO_DTYPE[dtype]
    assert list(message.shape) == list(shape)
    assert len(message.data) == arr.size * np.dtype(dtype).itemsize  # raw bytes, nothing else
    back = codec.decode_array(types_pb2.Tensor.FromString(message.SerializeToString()))
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    np.testing.assert_array_equal(back, arr)


def test_wire_is_little_endian():
    message = codec.encode_array(np.array([1], dtype=">i8"), "int64")
    assert message.data == (1).to_bytes(8, "little")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_torch_round_trip(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    back = codec.decode_torch(codec.encode_torch(t))
    # bfloat16 widens to float32 exactly
    assert torch.equal(back.to(dtype), t)


def test_byte_count_mismatch_is_invalid_argument():
    message = types_pb2.Tensor(dtype=types_pb2.DTYPE_FLOAT32, shape=[3], data=b"\0" * 8)
    with pytest.raises(InvalidArgument, match="needs 12 bytes"):
        codec.decode_array(message)


def test_unknown_dtype_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        codec.decode_array(types_pb2.Tensor(dtype=77, shape=[1], data=b"\0" * 4))


def test_tokens_round_trip():
    tokens = [0, 1, 49151, 2**31 - 1]
    assert codec.decode_tokens(codec.encode_tokens(tokens)).tolist() == tokens
    with pytest.raises(InvalidArgument):
        codec.encode_tokens([2**31])
    with pytest.raises(InvalidArgument):
        codec.decode_tokens(b"\0" * 5)
