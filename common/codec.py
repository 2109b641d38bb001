"""The one place where tensors and token lists become wire bytes and back.

Wire format: raw little-endian bytes + dtype + shape (``temper.v1.Tensor``); token lists are
little-endian int32 bytes. numpy does the work; torch is imported only by the ``*_torch`` helpers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from temper.common.errors import InvalidArgument
from temper.v1 import types_pb2

if TYPE_CHECKING:
    import torch

DTYPE_TO_NUMPY: dict[int, np.dtype] = {
    types_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    types_pb2.DTYPE_INT64: np.dtype("<i8"),
    types_pb2.DTYPE_INT32: np.dtype("<i4"),
    types_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
}
NAME_TO_DTYPE: dict[str, int] = {
    "float32": types_pb2.DTYPE_FLOAT32,
    "int64": types_pb2.DTYPE_INT64,
    "int32": types_pb2.DTYPE_INT32,
    "float16": types_pb2.DTYPE_FLOAT16,
    "bfloat16": types_pb2.DTYPE_BFLOAT16,
}
DTYPE_TO_NAME = {v: k for k, v in NAME_TO_DTYPE.items()}
_ITEMSIZE = {types_pb2.DTYPE_BFLOAT16: 2, **{k: v.itemsize for k, v in DTYPE_TO_NUMPY.items()}}


def dtype_name(dtype: int) -> str:
    return DTYPE_TO_NAME.get(dtype, f"unknown({dtype})")


def encode_array(array: Any, dtype: str | None = None) -> types_pb2.Tensor:
    """Encode a numpy array (or anything np.asarray accepts) as a Tensor message."""
    arr = np.asarray(array)
    name = dtype or _infer_dtype_name(arr)
    if name == "bfloat16":
        raise InvalidArgument("encode bfloat16 tensors with encode_torch")
    if name not in NAME_TO_DTYPE:
        raise InvalidArgument(f"unsupported dtype {name!r}; use one of {sorted(NAME_TO_DTYPE)}")
    code = NAME_TO_DTYPE[name]
    arr = np.asarray(arr, dtype=DTYPE_TO_NUMPY[code])  # (ascontiguousarray would turn a scalar into 1-d)
    return types_pb2.Tensor(dtype=code, shape=list(arr.shape), data=arr.tobytes(order="C"))


def _infer_dtype_name(arr: np.ndarray) -> str:
    if arr.dtype.kind == "f":
        return "float16" if arr.dtype.itemsize == 2 else "float32"
    if arr.dtype.kind in "iub":
        return "int32" if arr.dtype == np.int32 else "int64"
    raise InvalidArgument(f"cannot encode array of dtype {arr.dtype}")


def decode_array(tensor: types_pb2.Tensor) -> np.ndarray:
    """Decode a Tensor message into a numpy array (bfloat16 is widened to float32).

    Raises InvalidArgument if the dtype is unknown or the byte count does not match the shape.
    """
    if tensor.dtype not in _ITEMSIZE:
        raise InvalidArgument(f"unknown tensor dtype {tensor.dtype}")
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"negative dimension in shape {shape}")
    if len(shape) > 8:
        raise InvalidArgument(f"tensor has {len(shape)} dimensions (at most 8)")
    count = math.prod(shape)  # Python ints: a shape like [2**62, 4] cannot overflow into a small count
    expected = count * _ITEMSIZE[tensor.dtype]
    if len(tensor.data) != expected:
        raise InvalidArgument(
            f"tensor of shape {list(shape)[:8]} and dtype {dtype_name(tensor.dtype)} needs {expected} bytes, got {len(tensor.data)}"
        )
    if tensor.dtype == types_pb2.DTYPE_BFLOAT16:
        raw = np.frombuffer(tensor.data, dtype="<u2").astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    return np.frombuffer(tensor.data, dtype=DTYPE_TO_NUMPY[tensor.dtype]).reshape(shape)


def encode_tokens(tokens: Iterable[int] | np.ndarray) -> bytes:
    arr = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise InvalidArgument("token id does not fit in int32")
    return np.ascontiguousarray(arr, dtype="<i4").tobytes()


def decode_tokens(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise InvalidArgument(f"token bytes must be a multiple of 4, got {len(data)}")
    return np.frombuffer(data, dtype="<i4")


def encode_floats(values: Sequence[float] | np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def decode_floats(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise InvalidArgument(f"float32 bytes must be a multiple of 4, got {len(data)}")
    return np.frombuffer(data, dtype="<f4")


_TORCH_NAMES = {"float32": "float32", "int64": "int64", "int32": "int32", "float16": "float16", "bfloat16": "bfloat16"}


def encode_torch(tensor: "torch.Tensor") -> types_pb2.Tensor:
    import torch

    t = tensor.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_NAMES:
        raise InvalidArgument(f"unsupported torch dtype {t.dtype}")
    if name == "bfloat16":
        raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
        return types_pb2.Tensor(dtype=types_pb2.DTYPE_BFLOAT16, shape=list(t.shape), data=raw)
    return encode_array(t.numpy(), name)


def decode_torch(tensor: types_pb2.Tensor) -> "torch.Tensor":
    import torch

    # np.frombuffer arrays are read-only; copy so torch owns writable memory.
    return torch.from_numpy(np.array(decode_array(tensor), copy=True))
