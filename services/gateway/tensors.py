"""A request's loss-input tensors, JSON (the SDK's TensorData) or protobuf (tinker_wire.Tensor), as
Temper's Tensor.

A 2-D CSR tensor (how the SDK sends 2-D target_tokens and weights) is made dense here, so a few
bytes can claim a huge tensor. Every shape is checked first (at most ``MAX_DIMS`` dimensions, none
negative, sizes multiplied in Python integers, which cannot overflow), and the dense bytes of all of
one request's tensors are counted against a ``Budget`` before anything is allocated. The budget is
the scheduler's message limit: a request whose tensors exceed it could not be forwarded anyway.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from temper.common.codec import encode_array
from temper.common.server_options import MAX_MESSAGE_BYTES
from temper.common.strings import shown
from temper.services.gateway import fields
from temper.services.gateway import tinker_wire_pb2 as wire
from temper.services.gateway.errors import invalid
from temper.v1 import types_pb2

MAX_DIMS = 8
_WIRE_DTYPES = {wire.DTYPE_FLOAT32: np.float32, wire.DTYPE_INT64: np.int64, wire.DTYPE_INT32: np.int32}
_JSON_DTYPES = {"float32": np.float32, "int64": np.int64}


class Budget:
    """The dense bytes one request's tensors may take, all together."""

    def __init__(self, limit_bytes: int = MAX_MESSAGE_BYTES):
        self.limit = self.left = limit_bytes

    def take(self, shape: list[int], dtype) -> None:
        self.left -= math.prod(shape) * np.dtype(dtype).itemsize
        if self.left < 0:
            raise invalid(f"the request's tensors take more than {self.limit} bytes once dense")


def check_shape(shape: list[int]) -> list[int]:
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise invalid(f"a tensor shape has at most {MAX_DIMS} dimensions, none negative")
    return shape


def _csr_to_dense(values: np.ndarray, crow: np.ndarray, col: np.ndarray, shape: list[int], budget: Budget) -> np.ndarray:
    """A 2-D CSR tensor as a dense one, pad 0."""
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
        raise invalid(f"sparse tensor of shape {shape[:MAX_DIMS]}: {len(crow)} row pointers, {len(col)} columns, "
                      f"{len(values)} values")
    counts = np.diff(crow)
    if crow[0] != 0 or crow[-1] != len(values) or (counts < 0).any():
        raise invalid("sparse tensor row pointers must rise from 0 to the number of values")
    if len(col) and (col.min() < 0 or col.max() >= shape[1]):
        raise invalid("sparse tensor indices out of range")
    budget.take(shape, values.dtype)
    dense = np.zeros(shape, dtype=values.dtype)
    dense[np.repeat(np.arange(shape[0]), counts), col] = values
    return dense


def _shaped(arr: np.ndarray, shape: list[int], budget: Budget) -> np.ndarray:
    if not shape:
        shape = [arr.size]
    if math.prod(check_shape(shape)) != arr.size:
        raise invalid(f"tensor of {arr.size} values does not fit shape {shape[:MAX_DIMS]}")
    budget.take(shape, arr.dtype)
    return arr.reshape(shape)


def tensor_from_json(obj: Any, budget: Budget | None = None, label: str = "tensor") -> types_pb2.Tensor:
    """TensorData JSON: ``data`` a flat list, ``shape``, optionally ``sparse_crow_indices`` and
    ``sparse_col_indices`` (CSR)."""
    budget = budget or Budget()
    if not isinstance(obj, Mapping):
        raise invalid(f"{label} must be a TensorData object")
    name = fields.string(obj, "dtype", where=f"{label}.")
    dtype = _JSON_DTYPES.get(name)
    if dtype is None:
        raise invalid(f"{label}.dtype must be float32 or int64, got {shown(name)}")
    data = obj.get("data")
    data = [] if data is None else data
    if dtype is np.int64:
        values = np.asarray(fields.integers(data, f"{label}.data", *fields.INT64), dtype=np.int64)
    else:
        values = np.asarray(fields.numbers(data, f"{label}.data"), dtype=np.float64).astype(np.float32)
        if not np.isfinite(values).all():
            raise invalid(f"{label}.data holds values beyond float32")
    shape = check_shape(fields.integers(obj.get("shape") or [], f"{label}.shape", 0, fields.INT64[1]))
    if obj.get("sparse_crow_indices") is not None:
        crow = fields.integers(obj["sparse_crow_indices"], f"{label}.sparse_crow_indices", *fields.INT64)
        col = fields.integers(obj.get("sparse_col_indices") or [], f"{label}.sparse_col_indices", *fields.INT64)
        arr = _csr_to_dense(values, np.asarray(crow, np.int64), np.asarray(col, np.int64), shape, budget)
    else:
        arr = _shaped(values, shape, budget)
    return encode_array(arr, name)


def tensor_from_wire(msg: wire.Tensor, budget: Budget | None = None) -> types_pb2.Tensor:
    budget = budget or Budget()
    dtype = _WIRE_DTYPES.get(msg.dtype)
    if dtype is None:
        raise invalid(f"tensor dtype {wire.DType.Name(msg.dtype) if msg.dtype in wire.DType.values() else msg.dtype} is not supported")
    name = "float32" if dtype is np.float32 else "int64"
    shape = check_shape(list(msg.shape))
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        arr = _csr_to_dense(frombuffer(csr.values, dtype), frombuffer(csr.crow_indices, np.int64),
                            frombuffer(csr.col_indices, np.int64), shape, budget)
    else:
        arr = _shaped(frombuffer(msg.dense, dtype), shape, budget)
    return encode_array(arr.astype(np.float32 if name == "float32" else np.int64), name)


def frombuffer(data: bytes, dtype) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise invalid(f"{len(data)} bytes are not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
