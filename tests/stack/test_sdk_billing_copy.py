"""Through the unmodified tinker SDK on one gateway stack (issue 33, item 1):

- ``get_billing_usage``: the tokens trained, prefilled and sampled equal what the SDK sent and got
  back; each cost is its quantity times the operator's rate (TEMPER_GATEWAY_PRICE_TABLE); storage is
  reported; another tenant sees none of it; malformed windows are 400.
- ``copy_weights``: a copy of the caller's own checkpoint (training kind, with a TTL, loaded into a
  new training client) and of one another tenant published (sampler kind, sampled) answers the same
  logprobs as its source, and still does after the source is deleted. A copy into another tenant, of
  an unpublished or unknown checkpoint, or with a malformed path or TTL is refused and changes nothing.

All share this module's stack (one stack start)."""

import json
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402

from fixtures_stack import tinker_sdk_env  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402

RATES = {"train_per_mtok": 3.0, "sample_per_mtok": 1.5, "prefill_per_mtok": 0.5, "storage_per_gb_month": 20.0}
RATE_OF = {"training": "train_per_mtok", "sampling_sample": "sample_per_mtok", "sampling_prefill": "prefill_per_mtok"}
EXAMPLES = [[5, 17, 42, 9, 77, 3, 18], [11, 12, 13, 14, 15]]
PROMPT = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_sdk_billing")
    prices = json.dumps({tiny_model_dir: RATES})
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("sdk-billing"), database_url=url, num_threads=1, gateway=True,
                    extra_env={"TEMPER_GATEWAY_PRICE_TABLE": prices}) as local:
        local.start()
        yield local


def datum(tokens):
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                    "weights": np.ones(len(tokens) - 1, np.float32)})


@pytest.fixture(scope="module")
def work(stack, tiny_model_dir):
    """Two steps, a sampler and a training checkpoint, one sample; what was sent and got back."""
    with tinker_sdk_env(stack):
        client = tinker.ServiceClient()
        try:
            tc = client.create_lora_training_client(tiny_model_dir, rank=4, seed=5).result()
            data = [datum(t) for t in EXAMPLES]
            for _ in range(2):
                tc.forward_backward(data, "cross_entropy").result()
                tc.optim_step(tt.AdamParams(learning_rate=5e-3)).result()
            sampler_path = tc.save_weights_for_sampler("s1").result().path
            state_path = tc.save_state("w1").result().path
            sc = client.create_sampling_client(model_path=sampler_path).result()
            sampled = sc.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=5, temperature=1.0, seed=3)).result()
            yield dict(client=client, tc=tc, data=data, sampler_path=sampler_path, state_path=state_path,
                       trained=2 * sum(d.model_input.length for d in data), prefilled=len(PROMPT),
                       sampled=sum(len(s.tokens) for s in sampled.sequences))
        finally:
            client.close("success")


def http(stack, method, path, key=None, body=None, headers=None):
    """(status, parsed body) of a plain request."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"X-API-Key": key} if key else {}), **(headers or {})}
    request = urllib.request.Request(stack.gateway_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def window():
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    return hour - timedelta(hours=1), hour + timedelta(hours=1)


def usage(stack, key=None):
    return tinker.AdminClient(base_url=stack.gateway_url, api_key=key or stack.api_key).get_billing_usage(*window()).result()


def test_billing_usage_counts_what_was_sent_and_prices_it(stack, work, tiny_model_dir):
    events = usage(stack).data
    totals = {}
    for e in events:
        assert e.base_model == tiny_model_dir
        kind = e.event_info.type
        if kind in RATE_OF:
            totals[kind] = totals.get(kind, 0) + e.event_info.token_count
            assert e.estimated_cost_usd == pytest.approx(e.event_info.token_count * RATES[RATE_OF[kind]] / 1e6)
            assert e.session_id == work["tc"].model_id.split(":train:")[0]
        elif kind == "storage":
            assert e.event_info.gigabyte_hours > 0
            assert e.estimated_cost_usd == pytest.approx(e.event_info.gigabyte_hours * RATES["storage_per_gb_month"] / 720)
    assert totals == {"training": work["trained"], "sampling_prefill": work["prefilled"], "sampling_sample": work["sampled"]}
    assert sum(e.event_info.count for e in events if e.event_info.type == "checkpoint") == 2
    assert any(e.event_info.type == "storage" for e in events)
    assert usage(stack, stack.key_for("billing-other")).data == []  # only the caller's tenant's usage
    # the cookbook's pricing file, at the operator's rates: its CostTracker prices a step with them
    cost_estimation = pytest.importorskip("tinker_cookbook.utils.cost_estimation")
    mp = pytest.MonkeyPatch()
    try:  # the cookbook keeps the file it fetched for the process: fetched afresh here, put back after
        mp.setattr(cost_estimation, "_pricing_fetched", False)
        mp.setattr(cost_estimation, "_pricing_entries", None)
        assert cost_estimation.load_model_pricing(url=f"{stack.gateway_url}/tinker/models.json") is not None
        tracker = cost_estimation.CostTracker(cost_estimation.fetch_model_pricing(tiny_model_dir))
        step = tracker.record_step(cost_estimation.TokenUsage(trained=totals["training"], sampled=totals["sampling_sample"],
                                                              prefill_uncached=totals["sampling_prefill"]))
    finally:
        mp.undo()
    token_costs = sum(e.estimated_cost_usd for e in events if e.event_info.type in RATE_OF)
    assert step["cost/step_usd"] == pytest.approx(token_costs)


def test_malformed_billing_windows_are_400(stack, work):
    start, end = window()
    admin = tinker.AdminClient(base_url=stack.gateway_url, api_key=stack.api_key)
    for bad in ((start + timedelta(minutes=5), end), (start, start + timedelta(days=15)), (end + timedelta(hours=5), end),
                (start + timedelta(days=3), start + timedelta(days=4))):
        with pytest.raises(tinker.BadRequestError):
            admin.get_billing_usage(*bad).result()
    for query in ("starting_on=yesterday&ending_before=2026-01-01T00:00:00Z", "ending_before=2026-01-01T00:00:00Z",
                  "starting_on=2026-01-01T00:00:00&ending_before=2026-01-01T01:00:00Z"):
        assert http(stack, "GET", f"/api/v1/billing/usage/events?{query}", stack.api_key)[0] == 400


def logprobs(client, path):
    return client.create_sampling_client(model_path=path).result().compute_logprobs(tt.ModelInput.from_ints(PROMPT)).result()


def project(stack, key, name):
    """A new project of the key's tenant (Temper's POST /api/v1/projects: the SDK has no call that makes one)."""
    status, body = http(stack, "POST", "/api/v1/projects", key, {"name": name})
    assert status == 200, body
    return body["project_id"]


def test_copy_within_the_tenant_loads_and_outlives_its_source(stack, work):
    client, tc = work["client"], work["tc"]
    rest = tinker.RestClient(base_url=stack.gateway_url, api_key=stack.api_key)
    me = project(stack, stack.api_key, "archive")
    before = logprobs(client, work["sampler_path"])
    archive = tinker.ServiceClient(project_id=me)  # the SDK's way: the copy lands in this client's project
    try:
        copy = archive.copy_weights(work["sampler_path"]).result()
    finally:
        archive.close("success")
    assert copy != work["sampler_path"] and copy.startswith("tinker://") and "/sampler_weights/s1" in copy
    state_copy = rest.copy_weights(work["state_path"], me, ttl_seconds=7200).result()
    info = next(c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == state_copy)
    assert info.expires_at is not None and timedelta(hours=1.9) < info.expires_at - datetime.now(timezone.utc) < timedelta(hours=2.1)
    # the training copy loads into a new training client with the source's weights
    restored = client.create_training_client_from_state(state_copy).result()
    want = [o["logprobs"].tolist() for o in tc.forward(work["data"], "cross_entropy").result().loss_fn_outputs]
    got = [o["logprobs"].tolist() for o in restored.forward(work["data"], "cross_entropy").result().loss_fn_outputs]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=1e-5, atol=1e-6)
    rest.delete_checkpoint_from_tinker_path(work["sampler_path"]).result()
    np.testing.assert_allclose(logprobs(client, copy)[1:], before[1:], rtol=1e-5, atol=1e-6)
    entries = http(stack, "GET", "/api/v1/audit?event_type=checkpoints", stack.api_key)[1]["entries"]
    assert {e["tinker_path"] for e in entries if e["event"] == "checkpoint_copy"} == {copy, state_copy}
    # both copies are in the project named (Temper's list filter by project)
    status, body = http(stack, "GET", f"/api/v1/training_runs?project_id={me}", stack.api_key)
    run_of = lambda path: path.removeprefix("tinker://").split("/")[0]  # noqa: E731
    assert status == 200 and {r["training_run_id"] for r in body["training_runs"]} == {run_of(copy), run_of(state_copy)}


def test_copy_of_a_published_checkpoint_and_the_refusals(stack, work):
    client, rest = work["client"], tinker.RestClient(base_url=stack.gateway_url, api_key=stack.api_key)
    other_key = stack.key_for("copy-other")
    other = tinker.RestClient(base_url=stack.gateway_url, api_key=other_key)
    other_name, me = project(stack, other_key, "theirs"), project(stack, stack.api_key, "mine")
    source = work["state_path"]
    listed = lambda: sorted(c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints)  # noqa: E731
    mine_before, theirs_before = listed(), other.list_user_checkpoints().result().checkpoints
    with pytest.raises(tinker.NotFoundError):  # not published to them
        other.copy_weights(source, other_name).result()
    with pytest.raises(tinker.NotFoundError):  # into another tenant's project
        rest.copy_weights(source, other_name).result()
    with pytest.raises(tinker.NotFoundError):
        rest.copy_weights(source.replace("/w1", "/nope"), me).result()
    with pytest.raises(tinker.BadRequestError):
        rest.copy_weights("tinker://not-a-path", me).result()
    with pytest.raises(tinker.BadRequestError):
        rest.copy_weights(source, me, ttl_seconds=10).result()
    other_session = tinker.ServiceClient(base_url=stack.gateway_url, api_key=other_key)
    try:
        sid = other_session.holder.get_session_id()
        status, _ = http(stack, "POST", "/api/v1/copy_weights", stack.api_key, {"source_path": source, "session_id": sid})
        assert status == 404  # another tenant's session
    finally:
        other_session.close("success")
    assert listed() == mine_before and other.list_user_checkpoints().result().checkpoints == theirs_before
    # once published, the other tenant copies it into its own tenant, and samples it
    sampler = work["tc"].save_weights_for_sampler("pub").result().path
    rest.publish_checkpoint_from_tinker_path(sampler).result()
    theirs = other.copy_weights(sampler, other_name).result()
    assert [c.tinker_path for c in other.list_user_checkpoints().result().checkpoints] == [theirs]
    # a request resent under the same X-Idempotency-Key (as the SDK resends) answers the first copy
    resend = lambda: http(stack, "POST", "/api/v1/copy_weights", other_key,  # noqa: E731
                          {"source_path": sampler, "destination_project_id": other_name}, {"X-Idempotency-Key": "k1"})
    first, again = resend(), resend()
    assert first[0] == 200 and again == first and first[1]["tinker_path"] != theirs
    # temper.client (gRPC) copies the same way, with the same checks
    from temper.client import NotFoundError

    grpc_client = stack.client("copy-other")
    try:
        grpc_rest = grpc_client.create_rest_client()
        over_grpc = grpc_rest.copy_weights(sampler, other_name).result()
        assert over_grpc not in (theirs, sampler) and over_grpc.endswith("/sampler_weights/pub")
        with pytest.raises(NotFoundError):
            grpc_rest.copy_weights(source, other_name).result()  # still unpublished
    finally:
        grpc_client.close().result()
    with pytest.raises(tinker.NotFoundError):  # the copy is theirs, not published: not readable by the source's owner
        rest.get_weights_info_by_tinker_path(theirs).result()
    their_client = tinker.ServiceClient(base_url=stack.gateway_url, api_key=other_key)
    try:
        np.testing.assert_allclose(logprobs(their_client, theirs)[1:], logprobs(client, sampler)[1:], rtol=1e-5, atol=1e-6)
    finally:
        their_client.close("success")
