"""The gateway against malformed, oversized and reused requests, in process (fastapi's TestClient)
with a scheduler stand-in that records what reaches it.

What is checked: a wrong type is a 400 in the SDK's error shape (never a 5xx, which the SDK resends
for minutes) and reaches nothing; a sequenced verb the gateway refuses after reading its seq still
spends that seq; sizes are bounded before anything is allocated; a (run, seq) reused for another
request is refused; error bodies never echo a large input; API keys are checked for form first.
"""

import json

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from google.protobuf import message_factory

from temper.common.codec import encode_tokens
from temper.scheduler.db.keys import new_key
from temper.services.gateway import tinker_wire_pb2 as wire
from temper.services.gateway.app import create_app
from temper.services.gateway.errors import GatewayError, error_body, failed_result
from temper.v1 import service_pb2, types_pb2

KEY = {"X-API-Key": "tml-k"}
PROTO = "application/x-protobuf"
JSON_LIMIT = 300_000  # the app's body limits in these tests
RUN = "s:train:0"
_METHODS = service_pb2.DESCRIPTOR.services_by_name["Temper"].methods_by_name


class Scheduler:
    """Answers every call with an empty response of its type; refuses an empty forward_backward as
    the real scheduler does (which is how the gateway spends a seq)."""

    def __init__(self):
        self.calls = []

    async def call(self, method, request, key):
        self.calls.append((method, request))
        return message_factory.GetMessageClass(_METHODS[method].output_type)()

    async def verb(self, method, request, key):
        if method == "ForwardBackward" and not request.data:
            self.calls.append((method, request))
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "forward_backward needs at least one datum")
        if method == "Sample":
            self.calls.append((method, request))
            return types_pb2.SampleResponse(sequences=[types_pb2.SampledSequence() for _ in range(request.num_samples)])
        return await self.call(method, request, key)

    async def close(self):
        pass


@pytest.fixture
def gw():
    scheduler = Scheduler()
    with TestClient(create_app(scheduler, long_poll_seconds=5, json_body_limit=JSON_LIMIT, protobuf_body_limit=2 * JSON_LIMIT),
                    raise_server_exceptions=False) as http:
        http.scheduler = scheduler
        yield http


def refused(resp, status=400, code="INVALID_ARGUMENT"):
    """The SDK's error shape, not to be resent."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == code and body["category"] == "user" and isinstance(body["error"], str)
    assert resp.headers["x-should-retry"] == "false"
    return body["error"]


def retrieve(gw, submitted, headers=KEY):
    assert submitted.status_code == 200, submitted.text
    return gw.post("/api/v1/retrieve_future", json=submitted.json(), headers=headers).json()


TOKENS = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
SAMPLE = {"sampling_session_id": "s:sample:0", "seq_id": 1, "prompt": TOKENS, "sampling_params": {"max_tokens": 2}}


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/create_session", {"tags": "abc"}),  # not turned into ["a", "b", "c"]
    ("POST", "/create_session", {"tags": 1.5}),
    ("POST", "/create_session", {"user_metadata": [1]}),
    ("POST", "/create_session", {"user_metadata": "abc"}),
    ("POST", "/session_heartbeat", {"session_id": 5}),
    ("POST", "/sessions/s/finish", {"reason": "x"}),
    ("POST", "/sessions/s/finish", {"reason": {"type": 1}}),
    ("POST", "/create_model", {"session_id": "s", "base_model": "m", "model_seq_id": "abc"}),
    ("POST", "/create_model", {"session_id": "s", "base_model": "m", "model_seq_id": 1.5}),
    ("POST", "/create_model", {"session_id": "s", "base_model": "m", "model_seq_id": True}),
    ("POST", "/create_model", {"session_id": None, "base_model": "m", "model_seq_id": 0}),  # not "None:create_model:0"
    ("POST", "/create_model", {"session_id": "s", "base_model": "m", "lora_config": {"rank": 2**40}}),
    ("POST", "/load_weights", {"session_id": "s", "model_seq_id": [1], "path": "tinker://r/weights/a", "optimizer": False}),
    ("POST", "/get_info", {"model_id": 5}),
    ("POST", "/create_sampling_session", {"session_id": ["s"], "base_model": "m"}),
    ("POST", "/asample", {**SAMPLE, "num_samples": 2**31 - 1}),  # no 2e9 sequence ids first
    ("POST", "/asample", {**SAMPLE, "num_samples": "2"}),
    ("POST", "/asample", {**SAMPLE, "sampling_params": "x"}),
    ("POST", "/asample", {**SAMPLE, "seq_id": "abc"}),
    ("POST", "/asample", {**SAMPLE, "sampling_params": {"top_k": 2**63}}),
    ("POST", "/asample", {**SAMPLE, "sampling_params": {"seed": 2**64}}),
    ("POST", "/asample", {**SAMPLE, "sampling_params": {"stop": ["a", 1]}}),
    ("POST", "/asample", {**SAMPLE, "prompt": {"chunks": [{"tokens": [1.9]}]}}),  # not truncated to 1
    ("POST", "/asample", {**SAMPLE, "prompt": {"chunks": [{"tokens": [2**31]}]}}),
    ("POST", "/forward", {"model_id": RUN, "seq_id": 1.9}),  # not seq 1
    ("POST", "/optim_step", {"model_id": RUN, "seq_id": True}),
    ("POST", "/save_weights", {"model_id": 5, "seq_id": 1}),
    ("POST", "/retrieve_future", {"request_id": ["a"]}),
    ("POST", "/weights_info", {"tinker_path": "abc"}),  # the TemperError of parse_path
    ("PUT", "/training_runs/r/checkpoints/weights/a/ttl", {"ttl_seconds": "abc"}),
    ("PUT", "/training_runs/r/checkpoints/bogus/a/ttl", {"ttl_seconds": 5}),
    ("DELETE", "/training_runs/r/checkpoints/bogus/x", None),
    ("POST", "/training_runs/r/checkpoints/bogus/x/publish", None),
    ("GET", "/training_runs?offset=99999999999999999999999", None),
    ("GET", "/training_runs?limit=99999999999", None),
])
def test_wrong_types_are_400_and_reach_nothing(gw, method, path, body):
    resp = gw.request(method, "/api/v1" + path, headers=KEY, content=None if body is None else json.dumps(body))
    refused(resp)
    assert gw.scheduler.calls == []


@pytest.mark.parametrize("raw", [b"[" * 2000 + b"]" * 2000, b'{"tags": NaN}', b'{"a": Infinity}', b"\xff", b"[1]"])
def test_bodies_that_are_not_json_objects(gw, raw):
    refused(gw.post("/api/v1/create_session", content=raw, headers=KEY))
    assert gw.scheduler.calls == []


def _fb(seq, data=None, **fwd):
    data = [{"model_input": TOKENS, "loss_fn_inputs": {}}] if data is None else data
    return {"model_id": RUN, "seq_id": seq, "forward_input": {"loss_fn": "cross_entropy", "data": data, **fwd}}


def _tensor(**fields):
    return [{"model_input": TOKENS, "loss_fn_inputs": {"weights": {"dtype": "float32", **fields}}}]


def _wire(seq, shape, crow=None, values=2):
    msg = wire.ForwardBackwardRequest(model_id=RUN, seq_id=seq, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = encode_tokens([1, 2])
    tensor = datum.loss_fn_inputs["weights"]
    tensor.dtype, tensor.shape[:] = wire.DTYPE_FLOAT32, shape
    if crow is None:
        tensor.dense = np.ones(values, "<f4").tobytes()
    else:
        tensor.sparse_csr.values = np.ones(values, "<f4").tobytes()
        tensor.sparse_csr.crow_indices = np.asarray(crow, "<i8").tobytes()
        tensor.sparse_csr.col_indices = np.zeros(1, "<i8").tobytes()
    return msg.SerializeToString()


@pytest.mark.parametrize("path, body, expected", [
    ("/forward", _fb(7, data="x"), "data must be a list"),
    ("/forward", _fb(7, loss_fn_config={"a": None}), "loss_fn_config"),
    ("/forward", _fb(7, data=_tensor(data=["a"])), "finite numbers"),
    ("/forward", _fb(7, data=_tensor(data=[[1.0, 2.0], [3.0]])), "finite numbers"),  # ragged
    ("/forward", _fb(7, data=_tensor(data=[1.0, 2.0], shape=[2, 2], sparse_crow_indices=[0, 2, 1],
                                     sparse_col_indices=[0, 1])), "row pointers"),
    ("/forward", _fb(7, data=_tensor(data=[1.0], shape=[1, 2**40], sparse_crow_indices=[0, 1],
                                     sparse_col_indices=[0])), "bytes once dense"),  # before np.zeros
    ("/forward", _fb(7, data=_tensor(data=[], shape=[2**32, 2**32])), "does not fit"),  # no int64 wrap to 0
    ("/forward", _fb(7, data=[{"model_input": {"chunks": [{"type": "image" * 5000}]}}]), "characters long"),
    ("/optim_step", {"model_id": RUN, "seq_id": 7, "adam_params": "x"}, "adam_params must be an object"),
    ("/optim_step", {"model_id": RUN, "seq_id": 7, "adam_params": {"beta1": "0.9"}}, "beta1"),
    ("/save_weights", {"model_id": RUN, "seq_id": 7, "path": 1.5}, "path must be a string"),
    ("/save_weights", {"model_id": RUN, "seq_id": 7, "ttl_seconds": 2**70}, "ttl_seconds"),
    ("/load_weights", {"model_id": RUN, "seq_id": 7, "path": "p", "optimizer": "yes"}, "optimizer"),
    ("/save_weights_for_sampler", {"model_id": RUN, "seq_id": 7, "kind": "mutable"}, "snapshot or inflight"),
    ("/save_weights_for_sampler", {"model_id": RUN, "seq_id": 7, "kind": 1}, "kind must be a string"),
    ("/save_weights_for_sampler", {"model_id": RUN, "seq_id": 7, "kind": ["inflight"]}, "kind must be a string"),
    ("/save_weights_for_sampler", {"model_id": RUN, "seq_id": 7, "kind": "inflight", "path": "p"}, "takes no path"),
    ("/save_weights_for_sampler", {"model_id": RUN, "seq_id": 7, "path": 1.5}, "path must be a string"),
    ("/save_weights_for_sampler", {"model_id": "no-session", "seq_id": 7}, "<session>:train:<n>"),
])
def test_a_refused_sequenced_verb_spends_its_seq(gw, path, body, expected):
    failed = retrieve(gw, gw.post("/api/v1" + path, json=body, headers=KEY))
    assert failed["category"] == "user" and failed["error"].startswith("INVALID_ARGUMENT: ") and expected in failed["error"]
    assert len(failed["error"]) < 600
    [(method, spent)] = gw.scheduler.calls  # the empty forward_backward that spends the seq, nothing else
    assert (method, spent.training_run_id, spent.seq_id, len(spent.data)) == ("ForwardBackward", body["model_id"], 7, 0)


@pytest.mark.parametrize("shape, crow, values, expected", [
    ([-3, -1], None, 2, "none negative"),
    ([2**32, 2**32], None, 0, "does not fit"),  # its size is not 0 (numpy's int64 product would be)
    ([1, 2**40], [0, 1], 1, "bytes once dense"),
    ([2, 2], [0, 5, 1], 1, "row pointers"),
])
def test_protobuf_tensors_are_checked_before_allocating(gw, shape, crow, values, expected):
    submitted = gw.post("/api/v1/forward_backward", content=_wire(9, shape, crow, values), headers={**KEY, "Content-Type": PROTO})
    failed = retrieve(gw, submitted)
    assert expected in failed["error"] and failed["category"] == "user"
    [(method, spent)] = gw.scheduler.calls
    assert method == "ForwardBackward" and spent.seq_id == 9 and not spent.data


def test_bodies_over_the_limit_are_413(gw):
    big = json.dumps({"tags": ["x" * JSON_LIMIT]})
    refused(gw.post("/api/v1/create_session", content=big, headers=KEY), status=413)  # by Content-Length

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(10):
            yield b" " * (JSON_LIMIT // 8)
    refused(gw.post("/api/v1/create_session", content=chunks(), headers=KEY), status=413)
    oversize = gw.post("/v1/completions", content=big, headers={"Authorization": "Bearer tml-k"})
    assert oversize.status_code == 413 and oversize.json()["error"]["type"] == "invalid_request_error"
    as_proto = {**KEY, "Content-Type": PROTO}
    refused(gw.post("/api/v1/forward_backward", content=b"\0" * (2 * JSON_LIMIT + 1), headers=as_proto), status=413)
    assert gw.scheduler.calls == []
    body = _wire(1, [100_000], values=100_000)  # over the JSON limit, under the protobuf one
    assert JSON_LIMIT < len(body) < 2 * JSON_LIMIT
    assert retrieve(gw, gw.post("/api/v1/forward_backward", content=body, headers=as_proto))["loss_fn_outputs"] == []


def test_a_reused_seq_is_refused_and_a_resent_request_joins(gw):
    first = _fb(3, data=_tensor(data=[1.0, 1.0]))
    assert gw.post("/api/v1/forward", json=first, headers=KEY).json() == {"request_id": f"{RUN}:3"}
    assert gw.post("/api/v1/forward", json=first, headers=KEY).json() == {"request_id": f"{RUN}:3"}  # a resend joins
    other = gw.post("/api/v1/optim_step", json={"model_id": RUN, "seq_id": 3, "adam_params": {}}, headers=KEY)
    assert "already made with another body" in refused(other, 409, "ALREADY_EXISTS")
    changed = gw.post("/api/v1/forward", json=_fb(3, data=_tensor(data=[2.0, 2.0])), headers=KEY)
    refused(changed, 409, "ALREADY_EXISTS")
    assert "loss_fn_outputs" in retrieve(gw, gw.post("/api/v1/forward", json=first, headers=KEY))
    assert [m for m, _ in gw.scheduler.calls] == ["ForwardBackward"]


def test_asample_without_seq_id_is_never_joined(gw):
    body = {k: v for k, v in SAMPLE.items() if k != "seq_id"}
    a = gw.post("/api/v1/asample", json=body, headers=KEY).json()
    b = gw.post("/api/v1/asample", json=body, headers=KEY).json()
    assert a["request_id"] != b["request_id"]
    for future in (a, b):
        assert gw.post("/api/v1/retrieve_future", json=future, headers=KEY).json()["type"] == "sample"
    tags = [r.request_tag for m, r in gw.scheduler.calls]
    assert len(tags) == 2 and tags[0] != tags[1]
    assert [f"s:sample:0:{t}:0" for t in tags] == [a["sample_sequence_ids"][0], b["sample_sequence_ids"][0]]
    with_seq = gw.post("/api/v1/asample", json=SAMPLE, headers=KEY).json()
    assert gw.post("/api/v1/asample", json=SAMPLE, headers=KEY).json() == with_seq == {
        "request_id": "s:sample:0:1", "sample_sequence_ids": ["s:sample:0:1:0"]}
    gw.post("/api/v1/retrieve_future", json=with_seq, headers=KEY)
    assert len(gw.scheduler.calls) == 3


def test_error_bodies_do_not_echo_large_inputs(gw):
    huge = "Q" * 200_000
    gone = gw.post("/api/v1/retrieve_future", json={"request_id": "r" * 1000}, headers=KEY)
    assert gone.status_code == 410 and len(gone.text) < 200
    assert len(refused(gw.post("/api/v1/create_model", json={"session_id": "s", "base_model": "m",
                                                              "optimizer_config": {"type": huge}}, headers=KEY))) < 200
    assert len(refused(gw.post("/api/v1/checkpoints/search", json={huge: 1}, headers=KEY))) < 1200
    assert len(gw.post("/api/v1/" + "z" * 8000, headers=KEY).text) < 1200
    openai = gw.post("/v1/completions", json={"model": "m", "prompt": "x", "temperature": huge[:3000]},
                     headers={"Authorization": "Bearer tml-k"})
    assert openai.status_code == 400 and len(openai.text) < 300
    error = GatewayError(grpc.StatusCode.NOT_FOUND, huge)
    assert len(error_body(error)["error"]) < 1100 and len(failed_result(error)["error"]) < 1100


@pytest.mark.parametrize("body", [
    {"prompt": [[1, 2], [2**40]]}, {"seed": 2**63}, {"top_k": 2**63}, {"response_format": "json"},
    {"stream": True, "stream_options": "x"}, {"echo": "yes"}, {"temperature": 1e300},
])
def test_openai_client_mistakes_are_400(gw, body):
    resp = gw.post("/v1/completions", json={"model": "m", "prompt": "hi", **body}, headers={"Authorization": "Bearer tml-k"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert resp.headers["x-should-retry"] == "false" and gw.scheduler.calls == []


@pytest.mark.parametrize("key", [b"tml-\xc3\xa9", b"tml-" + b"k" * 16_000, b"tml-a b"])
def test_malformed_api_keys_are_401(gw, key):
    refused(gw.get("/api/v1/get_server_capabilities", headers={"X-API-Key": key}), 401, "UNAUTHENTICATED")
    refused(gw.post("/api/v1/asample", json=SAMPLE, headers={"X-API-Key": key}), 401, "UNAUTHENTICATED")
    assert gw.scheduler.calls == []


def test_keys_temper_issues_pass(gw):
    for headers in ({"X-API-Key": new_key()}, {"Authorization": f"Bearer {new_key()}"}):
        assert gw.get("/api/v1/get_server_capabilities", headers=headers).status_code == 200
    assert len(gw.scheduler.calls) == 2


@pytest.mark.parametrize("path", ["/get_info", "/create_sampling_session", "/weights_info", "/create_session", "/asample",
                                  "/forward", "/checkpoints/search", "/retrieve_future"])
def test_no_key_is_401_whatever_the_body(gw, path):
    refused(gw.post("/api/v1" + path, content=b"[not json", headers={}), 401, "UNAUTHENTICATED")
