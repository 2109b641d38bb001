"""The HTTP gateway SIGKILLed while the unmodified tinker SDK waits on training futures: the SDK's
futures still resolve (the restarted gateway reads each sequenced verb's answer back from the
scheduler: GetRequestResult), with the numbers a twin run gets, and the run goes on."""

import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402

from fixtures_stack import raw_stub, request_rows, sft_datum  # noqa: E402
from temper.client import AdamParams  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402
from temper.v1 import service_pb2  # noqa: E402

TOKENS = [5, 17, 42, 9, 77, 3, 18]


@pytest.fixture
def stack(tiny_model_dir, new_postgres_database, tmp_path):
    url = new_postgres_database("temper_gateway_restart")
    with LocalStack(tiny_model_dir, tmp_path, database_url=url, num_threads=1, gateway=True) as local:
        local.address, local.url = local.start(), url
        yield local


def sdk_datum(tokens):
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(len(tokens) - 1, np.float32)})


def wait_rows(url, run_id, count, timeout=60.0):
    deadline = time.monotonic() + timeout
    while len(request_rows(url, run_id)) < count:
        assert time.monotonic() < deadline, request_rows(url, run_id)
        time.sleep(0.05)


def test_training_futures_survive_a_gateway_sigkill(stack, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", stack.gateway_url)
    monkeypatch.setenv("TINKER_API_KEY", stack.api_key)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    sdk = tinker.ServiceClient()
    ours = stack.client()
    try:
        tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=3).result()
        twin = ours.create_lora_training_client(tiny_model_dir, rank=4, seed=3).result(timeout=300)
        adam = tt.AdamParams(learning_rate=5e-3, eps=1e-8)
        stack.pause("trainer")  # the verbs stay unanswered until after the gateway's restart
        try:
            pending = [tc.forward_backward([sdk_datum(TOKENS)], "cross_entropy"), tc.optim_step(adam)]
            wait_rows(stack.url, tc.model_id, 2)  # the scheduler has both: what the restarted gateway reads back
            stack.restart("gateway", crash=True)
        finally:
            stack.resume("trainer")
        fb, step = (f.result() for f in pending)

        want_fb = twin.forward_backward([sft_datum(TOKENS)], "cross_entropy").result(timeout=300)
        want_step = twin.optim_step(AdamParams(learning_rate=5e-3, eps=1e-8)).result(timeout=300)
        assert fb.metrics["loss:sum"] == want_fb.metrics["loss:sum"]
        np.testing.assert_array_equal(fb.loss_fn_outputs[0]["logprobs"].to_numpy(), want_fb.loss_fn_outputs[0]["logprobs"].to_numpy())
        assert step.metrics == pytest.approx(want_step.metrics)
        # the run goes on through the new gateway, every request once
        after = tc.forward_backward([sdk_datum(TOKENS)], "cross_entropy").result()
        assert after.metrics["loss:sum"] == twin.forward_backward([sft_datum(TOKENS)], "cross_entropy").result(timeout=300).metrics["loss:sum"]
        assert request_rows(stack.url, tc.model_id) == [(1, "forward_backward", "done"), (2, "optim_step", "done"),
                                                        (3, "forward_backward", "done")]
        # the lookup itself: the caller's own runs only, and a seq never sent is NOT_FOUND
        stub = raw_stub(stack)
        answer = stub.GetRequestResult(service_pb2.GetRequestResultRequest(training_run_id=tc.model_id, seq_id=2), timeout=60)
        assert answer.done and answer.kind == "optim_step" and answer.WhichOneof("answer") == "optim_step"
        for seq in (0, 99):
            with pytest.raises(Exception) as err:
                stub.GetRequestResult(service_pb2.GetRequestResultRequest(training_run_id=tc.model_id, seq_id=seq), timeout=60)
            assert err.value.code().name == ("INVALID_ARGUMENT" if seq == 0 else "NOT_FOUND")
    finally:
        sdk.close("success") if hasattr(sdk, "close") else None
        ours.close()
