"""Through the unmodified tinker SDK on one gateway stack (issue 33, items 1 and 4):

- ``RestClient.export_session_trace`` polls GET /api/v1/sessions/{id}/trace_export until ready and
  returns a signed URL; a plain GET of it (no key) is the session's trace, holding the requests the
  SDK made. A tampered URL is 403; another tenant's session and unknown or malformed ids are refused
  as the other session routes refuse them.
- The console's loss per weight of each forward_backward equals the cookbook's train_mean_nll
  (``compute_mean_nll``: sum of weighted NLL / sum of weights) of the same answer, prompt tokens
  weighted 0; rows without a loss (optim_step) show none.

Both share this module's stack (one stack start: the suite runs near its time limit)."""

import json

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402
from tinker_cookbook.supervised.common import compute_mean_nll  # noqa: E402

from fixtures_stack import plain_get, sdk_rest_client, tinker_sdk_env  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402

ADAM = dict(learning_rate=5e-3, eps=1e-8)
# (prompt, completion): the prompt's targets weighted 0, the completion's 1, as the cookbook's renderers do
EXAMPLES = [([5, 17, 42, 9, 77], [3, 18, 4]), ([11, 12, 13, 14, 15, 16, 17], [18, 19]), ([21, 22], [23, 24, 25, 26, 27])]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_sdk_trace")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("sdk-trace"), database_url=url, num_threads=1, gateway=True) as local:
        local.start()
        yield local


@pytest.fixture(scope="module")
def trained(stack, tiny_model_dir):
    """A session of the SDK with one run: two steps of forward_backward + optim_step on prompt-masked
    data; yields (run id, session id, the forward_backward answers, the data)."""
    with tinker_sdk_env(stack):
        client = tinker.ServiceClient()
        try:
            tc = client.create_lora_training_client(tiny_model_dir, rank=4, seed=5).result()
            data = [datum(prompt, completion) for prompt, completion in EXAMPLES]
            answers = []
            for _ in range(2):
                answers.append(tc.forward_backward(data, "cross_entropy").result())
                tc.optim_step(tt.AdamParams(**ADAM)).result()
            yield tc.model_id, tc.model_id.split(":train:")[0], answers, data
        finally:
            client.close("success")


def datum(prompt, completion):
    tokens = prompt + completion
    weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * len(completion), np.float32)
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": weights})






def test_export_session_trace_returns_a_signed_url_of_the_sessions_trace(stack, trained):
    run_id, session_id, _, _ = trained
    url = sdk_rest_client(stack).export_session_trace(session_id).result()
    assert url.startswith(stack.gateway_url + "/api/v1/trace_exports/")
    status, _, body = plain_get(url)  # no key: the signature is the credential
    assert status == 200
    trace = json.loads(body)
    spans = [e for e in trace["traceEvents"] if e.get("cat") == "request"]
    assert trace["otherData"]["session_id"] == session_id
    assert sorted(e["name"].split(" #")[0] for e in spans) == ["forward_backward"] * 2 + ["optim_step"] * 2
    assert {e["args"]["training_run_id"] for e in spans} == {run_id}

    tampered = url[:-1] + ("0" if url[-1] != "0" else "1")
    assert plain_get(tampered)[0] == 403
    assert plain_get(url.replace("expires=", "expires=9"))[0] == 403


def test_export_of_another_tenants_or_an_unknown_session_is_refused(stack, trained):
    _, session_id, _, _ = trained
    other = sdk_rest_client(stack, stack.key_for("trace-other"))
    with pytest.raises(tinker.NotFoundError):
        other.export_session_trace(session_id).result()
    with pytest.raises(tinker.NotFoundError):
        sdk_rest_client(stack).export_session_trace("no-such-session").result()
    # malformed ids: the same statuses as GET /api/v1/sessions/{id}
    key = stack.api_key
    for bad in ("x" * 5000, "%00", "a%20b"):
        want = plain_get(f"{stack.gateway_url}/api/v1/sessions/{bad}", key)[0]
        got = plain_get(f"{stack.gateway_url}/api/v1/sessions/{bad}/trace_export", key)[0]
        assert got == want and got in (400, 404), (bad, got, want)
    assert plain_get(f"{stack.gateway_url}/api/v1/sessions/{session_id}/trace_export")[0] == 401  # no key


def test_console_loss_per_weight_is_the_cookbooks_train_mean_nll(stack, trained):
    run_id, _, answers, data = trained
    status, _, body = plain_get(f"{stack.gateway_url}/console/api/runs/{run_id}/metrics", stack.api_key)
    assert status == 200
    rows = json.loads(body)["metrics"]
    fb = [r for r in rows if r["kind"] == "forward_backward"]
    assert len(fb) == len(answers) == 2
    weights = [d.loss_fn_inputs["weights"] for d in data]
    for row, answer in zip(fb, answers):
        want = compute_mean_nll([out["logprobs"] for out in answer.loss_fn_outputs], weights)
        # the same definition computed here in float64 (the cookbook's sums are float32: agree to ~1e-7)
        nll = -sum(float(np.dot(out["logprobs"].to_numpy().astype(np.float64), w.to_numpy()))
                   for out, w in zip(answer.loss_fn_outputs, weights))
        assert want == pytest.approx(nll / sum(float(w.to_numpy().sum()) for w in weights), rel=1e-6)
        assert row["loss_per_weight"] == pytest.approx(want, rel=1e-5)
        assert row["metrics"]["weights:sum"] == sum(len(c) for _, c in EXAMPLES)
        # what the old "loss per token" read: smaller by the prompt's share of the tokens
        assert row["loss"] / row["num_tokens"] < 0.8 * row["loss_per_weight"]
    for row in rows:
        if row["kind"] == "optim_step":
            assert row["loss"] is None and row["loss_per_weight"] is None, json.dumps(row)
            assert row["grad_norm"] > 0 and row["learning_rate"] == ADAM["learning_rate"]
    # optional fields that are set still read as set (views.py tells unset ones apart)
    detail = json.loads(plain_get(f"{stack.gateway_url}/console/api/runs/{run_id}", stack.api_key)[2])
    assert detail["run"]["lora_config"]["rank"] == 4
