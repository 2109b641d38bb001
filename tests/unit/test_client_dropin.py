"""temper.client as a drop-in for the Tinker SDK, without a server: coercion of loss_fn_inputs by key,
creation calls that are both a future and the client, the exception names Tinker users catch, and
a wrong or dead address failing fast with a clear message."""

import asyncio
import concurrent.futures
import socket
import time
import typing

import grpc
import numpy as np
import pytest

import temper.client as tc
from temper.client import Datum, ModelInput, RestClient, types
from temper.client.errors import error_for
from temper.client.futures import ClientFuture
from temper.client.runtime import resolve_base_url


def test_lists_coerce_by_key_as_in_tinker():
    d = Datum(model_input=ModelInput.from_ints([1, 2, 3]),
              loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1, 1, 0], "advantages": [1, -1, 0],
                              "logprobs": [-0.5, -1.0, -2.0], "mask": [1, 0, 1]})
    arrays = {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}
    assert arrays["target_tokens"].dtype == np.int64 and arrays["target_tokens"].tolist() == [2, 3, 4]
    assert arrays["weights"].dtype == np.float32 and d.loss_fn_inputs["weights"].dtype == "float32"
    assert arrays["advantages"].dtype == np.float32 and arrays["logprobs"].dtype == np.float32
    assert arrays["mask"].dtype == np.int64  # a key Tinker does not list keeps the list's kind
    # numpy values of a float key become float as well (int weights would be refused by the server)
    d = Datum(model_input=ModelInput.from_ints([1, 2]), loss_fn_inputs={"weights": np.ones(2, np.int64),
                                                                        "target_tokens": np.array([1, 2], np.int32)})
    assert d.loss_fn_inputs["weights"].dtype == "float32" and d.loss_fn_inputs["target_tokens"].dtype == "int64"
    with pytest.raises(ValueError, match="rectangular"):
        Datum(model_input=ModelInput.from_ints([1]), loss_fn_inputs={"weights": [[1.0], [1.0, 2.0]]})


class _Fake:
    model_id = "s:train:0"

    def forward_backward(self, data, loss_fn):
        return f"fb {len(data)} {loss_fn}"


def test_creation_result_is_a_future_and_the_client():
    pending = concurrent.futures.Future()
    fut = ClientFuture(pending)
    assert "pending" in repr(fut) and not fut.done()
    client = _Fake()
    pending.set_result(client)
    assert fut.result() is client
    assert fut.model_id == "s:train:0"                       # used as the client (the SDK's back-compat)
    assert fut.forward_backward([1, 2], "cross_entropy") == "fb 2 cross_entropy"
    assert asyncio.run(_await(fut)) is client               # awaited in asyncio code

    failed = concurrent.futures.Future()
    failed.set_exception(error_for(grpc.StatusCode.NOT_FOUND, "no such model"))
    with pytest.raises(tc.NotFoundError, match="no such model"):
        ClientFuture(failed).forward_backward  # the first use raises the creation's error


async def _await(fut):
    return await fut


@pytest.mark.parametrize("code, tinker_name, ours", [
    (grpc.StatusCode.INVALID_ARGUMENT, "BadRequestError", tc.InvalidArgument),
    (grpc.StatusCode.FAILED_PRECONDITION, "BadRequestError", tc.FailedPrecondition),
    (grpc.StatusCode.NOT_FOUND, "NotFoundError", tc.NotFound),
    (grpc.StatusCode.ALREADY_EXISTS, "ConflictError", tc.AlreadyExists),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "RateLimitError", tc.ResourceExhausted),
    (grpc.StatusCode.UNAUTHENTICATED, "AuthenticationError", tc.Unauthenticated),
    (grpc.StatusCode.UNAVAILABLE, "InternalServerError", tc.Unavailable),
    (grpc.StatusCode.INTERNAL, "InternalServerError", tc.TemperError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "APITimeoutError", tc.Unavailable),
    (grpc.StatusCode.UNIMPLEMENTED, "UnsupportedError", NotImplementedError),
])
def test_errors_are_caught_by_tinkers_names_and_ours(code, tinker_name, ours):
    exc = error_for(code, "why")
    assert isinstance(exc, getattr(tc, tinker_name)) and isinstance(exc, ours)
    assert isinstance(exc, tc.TinkerError) and isinstance(exc, tc.TemperError) and isinstance(exc, tc.APIError)
    assert exc.code == code and exc.message == "why"
    if isinstance(exc, tc.APIStatusError):  # a request the server failed: Tinker's RequestFailedError too
        assert isinstance(exc, tc.RequestFailedError) and exc.category in ("user", "server")
        assert exc.status_code >= 400


def test_every_exception_name_of_the_tinker_sdk_exists():
    tinker = pytest.importorskip("tinker")
    names = [n for n in tinker.__all__ if n.endswith("Error")]
    assert names and [n for n in names if not hasattr(tc, n)] == []
    for name in names:  # the same family tree where Tinker has one
        for base in getattr(tinker, name).__mro__[1:]:
            if base.__module__.startswith("tinker") and hasattr(tc, base.__name__):
                assert issubclass(getattr(tc, name), getattr(tc, base.__name__)), (name, base.__name__)


def _dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_dead_address_fails_within_the_connect_timeout():
    address = _dead_address()
    start = time.monotonic()
    with pytest.raises(tc.APIConnectionError, match="could not connect") as info:
        tc.ServiceClient(base_url=address, connect_timeout=1.0)
    assert time.monotonic() - start < 10
    assert address in str(info.value) and "gRPC" in str(info.value) and "connect_timeout" in str(info.value)
    assert isinstance(info.value, tc.Unavailable)


def test_the_connect_timeout_is_a_setting(monkeypatch):
    monkeypatch.setenv("TEMPER_CONNECT_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(tc.APIConnectionError, match="0.5 s"):
        RestClient(base_url=_dead_address())  # the SDK's RestClient() stands alone too
    assert time.monotonic() - start < 10


def test_addresses_from_temper_and_tinker_variables(monkeypatch):
    for name in ("TEMPER_BASE_URL", "TEMPER_ADDRESS", "TINKER_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_base_url(None) == "127.0.0.1:50051"
    monkeypatch.setenv("TINKER_BASE_URL", "grpc://sched:50051")
    assert resolve_base_url(None) == "grpc://sched:50051"
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:8080")  # the official SDK's gateway URL: not ours
    with pytest.raises(ValueError, match="temper.client speaks gRPC"):
        resolve_base_url(None)
    with pytest.raises(ValueError, match="temper.client speaks gRPC"):
        tc.ServiceClient()
    monkeypatch.setenv("TEMPER_ADDRESS", "sched:50051")
    assert resolve_base_url(None) == "sched:50051"
    monkeypatch.setenv("TEMPER_BASE_URL", "other:1")
    assert resolve_base_url(None) == "other:1" and resolve_base_url("mine:2") == "mine:2"
    with pytest.raises(ValueError, match="speaks gRPC"):
        tc.ServiceClient(base_url="https://tinker.example")


def test_rest_methods_temper_lacks_raise_a_clear_not_implemented():
    rest = RestClient(_runtime=object())
    for call in (rest.whoami, lambda: rest.get_external_weights_urls("tinker://r/weights/x"), lambda: rest.list_sessions()):
        with pytest.raises(NotImplementedError, match="not supported by Temper"):
            call()


def test_types_a_tinker_script_uses():
    assert types.ParsedCheckpointTinkerPath.from_tinker_path("tinker://s:train:0/sampler_weights/a").checkpoint_id == "sampler_weights/a"
    with pytest.raises(ValueError):
        types.ParsedCheckpointTinkerPath.from_tinker_path("tinker://s/other/a")
    assert set(typing.get_args(types.ModelInputChunk)) == {types.EncodedTextChunk, types.ImageChunk, types.ImageAssetPointerChunk}
    assert tc.OptimParams is tc.AdamParams
