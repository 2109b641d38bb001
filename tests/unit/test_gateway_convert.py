"""The gateway's pure translations (services/gateway/convert.py, errors.py, futures.py), no network.
Where the official SDK is installed, its own encoders and decoders are the reference."""

import asyncio

import grpc
import numpy as np
import pytest

from temper.common.codec import decode_array, decode_tokens, encode_array, encode_floats, encode_tokens
from temper.common.errors import HARD_LIMIT_PREFIX
from temper.services.gateway import convert
from temper.services.gateway import tinker_wire_pb2 as wire
from temper.services.gateway.errors import GatewayError, failed_result, http_headers, http_status
from temper.services.gateway.futures import Futures
from temper.v1 import types_pb2


def test_csr_tensors_become_dense():
    t = convert.tensor_from_json({"data": [7, 9], "dtype": "int64", "shape": [2, 3],
                                  "sparse_crow_indices": [0, 1, 2], "sparse_col_indices": [2, 0]})
    np.testing.assert_array_equal(decode_array(t), [[0, 0, 7], [9, 0, 0]])
    with pytest.raises(GatewayError):
        convert.tensor_from_json({"data": [1], "dtype": "int64", "shape": [1, 2], "sparse_crow_indices": [0, 1],
                                  "sparse_col_indices": [5]})
    with pytest.raises(GatewayError, match="dtype"):
        convert.tensor_from_json({"data": [1], "dtype": "bool"})
    with pytest.raises(GatewayError, match="shape"):
        convert.tensor_from_json({"data": [1, 2, 3], "dtype": "float32", "shape": [2]})


def test_json_forward_backward_and_params():
    body = {"model_id": "s:train:0", "seq_id": 3, "forward_backward_input": {
        "loss_fn": "ppo", "loss_fn_config": {"clip_low_threshold": 0.7, "mode": "x"},
        "data": [{"model_input": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
                  "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]}}}]}}
    req = convert.forward_backward_from_json(body, forward_only=False)
    assert (req.training_run_id, req.seq_id, req.loss_fn, req.forward_only) == ("s:train:0", 3, "ppo", False)
    assert req.loss_fn_config["clip_low_threshold"].number == 0.7 and req.loss_fn_config["mode"].text == "x"
    assert decode_tokens(req.data[0].model_input.chunks[0].encoded_text.tokens).tolist() == [1, 2, 3]
    with pytest.raises(GatewayError, match="not valid base64"):  # images themselves: test_gateway_images.py
        convert.model_input_from_json({"chunks": [{"type": "image", "data": "#", "format": "png"}]})
    adam = convert.adam_from_json({"adam_params": {"learning_rate": 0.01, "beta2": 0.99}})
    assert (adam.learning_rate, adam.beta1, adam.beta2) == (0.01, 0.9, 0.99)
    with pytest.raises(GatewayError, match="dimuon"):
        convert.adam_from_json({"optimizer_params": {"type": "dimuon"}})
    params = convert.sampling_params_from_json({"max_tokens": 4, "stop": [], "top_k": -1, "temperature": 0.5})
    assert params.stop_disabled and params.max_tokens == 4 and params.top_k == 0
    assert convert.session_of("abc:train:2") == "abc" and convert.run_id("abc", 2) == "abc:train:2"
    with pytest.raises(GatewayError):
        convert.session_of("abc")


def _temper_fwdbwd():
    out = types_pb2.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={"loss:sum": 1.5, "bare": 2.0})
    for n in (3, 5):
        out.loss_fn_outputs.add(fields={"logprobs": encode_array(np.arange(n, dtype=np.float32) - 9, "float32"),
                                        "elementwise_loss": encode_array(np.ones(n, np.float32), "float32")})
    return out


def _temper_sample():
    resp = types_pb2.SampleResponse(prompt_logprobs=encode_array(np.array([np.nan, np.nan, -2.0, -3.0], np.float32), "float32"),
                                    prompt_cache_hit_tokens=3)
    resp.sequences.add(stop_reason=types_pb2.STOP_REASON_STOP, tokens=encode_tokens([4, 5]), logprobs=encode_floats([-0.5, -0.25]),
                       topk=2, topk_token_ids=encode_tokens([4, 1, 5, 2]), topk_logprobs=encode_floats([-0.5, -1, -0.25, -2]),
                       sequence_id="s:sample:0:7:0")
    resp.sequences.add(stop_reason=types_pb2.STOP_REASON_LENGTH, tokens=encode_tokens([6]), logprobs=encode_floats([-0.1]),
                       sequence_id="s:sample:0:7:1")
    # top-2 prompt logprobs, scored at the last 2 positions (prompt_logprobs_last_n=2): the others are Tinker's sentinel
    ids = np.array([[0, 0], [0, 0], [3, 9], [8, 1]], np.int32)
    lps = np.array([[-99999.0] * 2, [-99999.0] * 2, [-0.5, -2.0], [-0.25, -3.0]], np.float32)
    resp.topk_prompt_token_ids.CopyFrom(encode_array(ids, "int32"))
    resp.topk_prompt_logprobs.CopyFrom(encode_array(lps, "float32"))
    return resp


def test_results_as_json():
    body = convert.forward_backward_to_json(_temper_fwdbwd())
    assert body["metrics"] == {"loss:sum": 1.5, "bare:mean": 2.0}  # the SDK splits every key at ":"
    assert body["loss_fn_outputs"][1]["logprobs"] == {"data": [-9, -8, -7, -6, -5], "dtype": "float32", "shape": [5]}
    sample = convert.sample_to_json(_temper_sample())
    assert sample["prompt_logprobs"] == [None, None, -2.0, -3.0]
    assert sample["topk_prompt_logprobs"] == [None, None, [(3, -0.5), (9, -2.0)], [(8, -0.25), (1, -3.0)]]
    assert [s["sequence_id"] for s in sample["sequences"]] == ["s:sample:0:7:0", "s:sample:0:7:1"]
    assert [s["stop_reason"] for s in sample["sequences"]] == ["stop", "length"]
    assert sample["sequences"][0]["topk_logprobs"] == [[(4, -0.5), (1, -1.0)], [(5, -0.25), (2, -2.0)]]
    assert sample["prompt_cache_hit_tokens"] == 3


def test_http_statuses_the_sdk_retries_or_raises():
    def status(code, message="m"):
        return http_status(GatewayError(code, message))

    assert status(grpc.StatusCode.INVALID_ARGUMENT) == 400 and status(grpc.StatusCode.NOT_FOUND) == 404
    assert status(grpc.StatusCode.ALREADY_EXISTS) == 409 and status(grpc.StatusCode.UNAUTHENTICATED) == 401
    assert status(grpc.StatusCode.RESOURCE_EXHAUSTED) == 429 and status(grpc.StatusCode.UNAVAILABLE) == 503
    assert status(grpc.StatusCode.UNIMPLEMENTED) == 404  # never a 5xx the SDK would resend for minutes
    hard = GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, HARD_LIMIT_PREFIX + "max_training_runs: 2")
    assert http_status(hard) == 403 and not hard.transient  # a hard quota is final
    assert GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full").transient
    assert http_headers(409) == {"x-should-retry": "false"} and http_headers(503) == {"x-should-retry": "true"}
    assert failed_result(GatewayError(grpc.StatusCode.NOT_FOUND, "no run")) == {"error": "NOT_FOUND: no run", "category": "user"}
    assert GatewayError.of(ValueError("secret")).code == grpc.StatusCode.INTERNAL


def test_futures_are_per_key_and_deduplicated():
    async def scenario():
        futures, calls = Futures(keep_seconds=10), []

        async def work():
            calls.append(1)
            return "done"

        assert futures.submit("k1", "run:1", work) == "run:1"
        futures.submit("k1", "run:1", work)  # a resent submission joins the first
        assert (await futures.wait("k2", "run:1", 0.01)) is None  # another key sees nothing
        entry = await futures.wait("k1", "run:1", 1.0)
        assert entry.task.result() == "done" and calls == [1]
        assert futures.sweep(now=entry.retrieved + 1) == 0 and futures.sweep(now=entry.retrieved + 61) == 1

    asyncio.run(scenario())


# ---- against the SDK's own protobuf codecs -------------------------------------------------------

def test_sdk_forward_backward_request_decodes():
    pytest.importorskip("tinker")
    from tinker import types as tt
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.types.forward_backward_request import ForwardBackwardRequest

    target = np.array([[3, 0], [0, 4]], np.int64)
    datum = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2]), loss_fn_inputs={
        "target_tokens": tt.TensorData(data=[3, 4], dtype="int64", shape=[2, 2], sparse_crow_indices=[0, 1, 2], sparse_col_indices=[0, 1]),
        "weights": np.array([0.5, -1.0], np.float32)})
    sdk_request = ForwardBackwardRequest(model_id="s:train:0", seq_id=7, forward_backward_input=tt.ForwardBackwardInput(
        data=[datum], loss_fn="cross_entropy", loss_fn_config={"beta": 0.1, "name": "x"}))
    body = forward_backward_request_to_proto(sdk_request).SerializeToString()
    req = convert.forward_backward_from_wire(convert.parse_forward_backward(body))
    assert (req.training_run_id, req.seq_id, req.loss_fn) == ("s:train:0", 7, "cross_entropy")
    assert req.loss_fn_config["beta"].number == 0.1 and req.loss_fn_config["name"].text == "x"
    np.testing.assert_array_equal(decode_array(req.data[0].loss_fn_inputs["target_tokens"]), target)
    np.testing.assert_array_equal(decode_array(req.data[0].loss_fn_inputs["weights"]), [0.5, -1.0])
    assert decode_tokens(req.data[0].model_input.chunks[0].encoded_text.tokens).tolist() == [1, 2]
    with pytest.raises(GatewayError):
        convert.parse_forward_backward(b"\xff\xff")


def test_results_decode_with_the_sdk():
    pytest.importorskip("tinker")
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    out = deserialize_forward_backward_output(convert.forward_backward_to_wire(_temper_fwdbwd()))
    assert out.metrics == {"loss:sum": 1.5, "bare:mean": 2.0} and len(out.loss_fn_outputs) == 2
    np.testing.assert_array_equal(out.loss_fn_outputs[1]["logprobs"].to_numpy(), np.arange(5, dtype=np.float32) - 9)
    assert out.loss_fn_outputs[0]["elementwise_loss"].shape == [3]
    sample = deserialize_sample_response(convert.sample_to_wire(_temper_sample()))
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[0].tokens == [4, 5] and sample.sequences[0].logprobs == [-0.5, -0.25]
    assert sample.sequences[0].topk_logprobs is not None
    assert sample.prompt_logprobs == [None, None, -2.0, -3.0]
    assert sample.topk_prompt_logprobs == [None, None, [(3, -0.5), (9, -2.0)], [(8, -0.25), (1, -3.0)]]
    assert sample.prompt_cache_hit_tokens == 3


def test_wire_schema_matches_the_sdk():
    """Field numbers and types of every message we share with the SDK's schema."""
    pytest.importorskip("tinker")
    from tinker.proto import tinker_public_pb2 as public

    for name, ours in wire.DESCRIPTOR.message_types_by_name.items():
        theirs = public.DESCRIPTOR.message_types_by_name[name]
        assert {(f.name, f.number, f.type) for f in ours.fields} <= {(f.name, f.number, f.type) for f in theirs.fields}, name


# ---- routes over a fake scheduler ----------------------------------------------------------------

class FakeScheduler:
    """Answers the verbs the routes call; records what it was sent."""

    def __init__(self):
        self.sent, self.release, self.records = [], None, {}

    async def verb(self, method, request, key):
        self.sent.append((method, request, key))
        if self.release is not None:
            await self.release.wait()
        if method == "ForwardBackward" and not request.data:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "no data")
        return _temper_fwdbwd()

    async def call(self, method, request, key):
        if method == "GetRequestResult":  # as the scheduler: its record of (run, seq), NOT_FOUND if none is the caller's
            record = self.records.get((request.training_run_id, request.seq_id))
            if record is None:
                raise GatewayError(grpc.StatusCode.NOT_FOUND, "not received")
            return record
        return await self.verb(method, request, key)

    async def close(self):
        pass


def test_a_restarted_gateway_reads_a_sequenced_verbs_answer_back_from_the_scheduler():
    from fastapi.testclient import TestClient

    from temper.services.gateway.app import create_app
    from temper.v1 import service_pb2

    fake, headers = FakeScheduler(), {"X-API-Key": "tml-k"}
    fake.records = {("s:train:0", 1): service_pb2.RequestResult(kind="forward_backward", done=True, forward_backward=_temper_fwdbwd()),
                    ("s:train:0", 2): service_pb2.RequestResult(kind="optim_step", done=False)}
    with TestClient(create_app(fake, long_poll_seconds=0.05)) as http:  # a new gateway: it holds no futures
        def retrieve(request_id):
            return http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)

        assert retrieve("s:train:0:1").json()["metrics"]["loss:sum"] == 1.5
        assert retrieve("s:train:0:2").json()["type"] == "try_again"  # still running at the scheduler
        assert retrieve("s:train:0:3").status_code == 410  # never reached the scheduler
        assert retrieve("some-sampling-future").status_code == 410  # not a sequenced verb: nothing to read back
        assert [m for m, _, _ in fake.sent] == []  # nothing was sent again


def test_routes_json_body_futures_and_protobuf_results():
    from fastapi.testclient import TestClient

    from temper.services.gateway.app import create_app

    fake = FakeScheduler()
    headers = {"X-API-Key": "tml-k"}
    with TestClient(create_app(fake, long_poll_seconds=0.05)) as http:
        body = {"model_id": "s:train:0", "seq_id": 1, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [
            {"model_input": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64"}}}]}}
        fake.release = asyncio.Event()
        future = http.post("/api/v1/forward_backward", json=body, headers=headers).json()
        assert future == {"request_id": "s:train:0:1"}
        poll = http.post("/api/v1/retrieve_future", json=future, headers=headers).json()
        assert poll["type"] == "try_again"  # still running after the long poll
        assert http.post("/api/v1/retrieve_future", json=future, headers={"X-API-Key": "tml-other"}).status_code == 410
        fake.release = None
        http.post("/api/v1/forward_backward", json={**body, "seq_id": 2}, headers=headers)
        done = http.post("/api/v1/retrieve_future", json={"request_id": "s:train:0:2"}, headers={**headers, "Accept": convert.PROTO})
        assert done.headers["content-type"] == convert.PROTO
        assert wire.ForwardBackwardOutput.FromString(done.content).metrics["loss:sum"] == 1.5
        as_json = http.post("/api/v1/retrieve_future", json={"request_id": "s:train:0:2"}, headers=headers).json()
        assert as_json["metrics"]["loss:sum"] == 1.5
        method, request, key = fake.sent[-1]
        assert (method, request.seq_id, key) == ("ForwardBackward", 2, "tml-k")  # the caller's key goes on

        # a body the gateway refuses after reading its seq still spends that seq at the scheduler
        bad = {**body, "seq_id": 3, "forward_backward_input": {**body["forward_backward_input"], "data": [
            {"model_input": {"chunks": [{"type": "dmel", "dmel": ""}]}, "loss_fn_inputs": {}}]}}
        http.post("/api/v1/forward_backward", json=bad, headers=headers)
        failed = http.post("/api/v1/retrieve_future", json={"request_id": "s:train:0:3"}, headers=headers).json()
        assert "audio (dmel)" in failed["error"] and failed["category"] == "user"
        assert fake.sent[-1][1].seq_id == 3 and not fake.sent[-1][1].data

        assert http.post("/api/v1/create_session", json={}).status_code == 401
        assert http.post("/api/v1/no_such_route", json={}, headers=headers).status_code == 404  # a route not served
        refused = http.post("/api/v1/asample", json={"sampling_session_id": "s:sample:0", "seq_id": 0, "prompt_alt_tokens_k": 3,
                                                      "prompt": {"chunks": []}, "sampling_params": {}}, headers=headers)
        assert refused.status_code == 400 and "prompt_alt_tokens_k" in refused.json()["error"]
