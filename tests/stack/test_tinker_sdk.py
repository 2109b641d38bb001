"""The official tinker SDK, unmodified, against the gateway (services/gateway) on the tiny model: it
only sees TINKER_BASE_URL and TINKER_API_KEY. Every number it gets equals what temper.client gets
for the same request on the same stack."""

import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402

from fixtures_stack import sft_datum  # noqa: E402
from temper.client import AdamParams, ModelInput, SamplingParams  # noqa: E402
from temper.common.errors import NotFound  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402

ADAM = dict(learning_rate=5e-3, eps=1e-8)
TOKENS = [[5, 17, 42, 9, 77, 3, 18], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def gw_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_gateway")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("gateway"), database_url=url, num_threads=1, gateway=True) as local:
        local.start()
        yield local


@pytest.fixture
def sdk(gw_stack, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", gw_stack.gateway_url)
    monkeypatch.setenv("TINKER_API_KEY", gw_stack.api_key)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    client = tinker.ServiceClient()
    yield client
    client.close("success")


def sdk_rest(stack, api_key=None):
    """A RestClient naming its gateway and key: the SDK keeps one session-less holder per
    (base_url, api_key) for the process, so a bare RestClient() would reuse whichever gateway the
    environment named first (another module's, stopped by now)."""
    return tinker.RestClient(base_url=stack.gateway_url, api_key=api_key or stack.api_key)


@pytest.fixture
def ours(gw_stack):
    client = gw_stack.client()
    yield client
    client.close()


def sdk_datum(tokens, **inputs):
    inputs = inputs or {"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(len(tokens) - 1, np.float32)}
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def assert_same_outputs(sdk_out, our_out):
    assert sdk_out.metrics["loss:sum"] == our_out.metrics["loss:sum"]
    for a, b in zip(sdk_out.loss_fn_outputs, our_out.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())


def test_sft_loop_checkpoints_and_resume(sdk, ours, gw_stack, tiny_model_dir):
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=3).result()
    mine = ours.create_lora_training_client(tiny_model_dir, rank=4, seed=3)
    for _ in range(2):  # submitted before waiting, as the SDK's docs do
        fb, opt = tc.forward_backward([sdk_datum(t) for t in TOKENS], "cross_entropy"), tc.optim_step(tt.AdamParams(**ADAM))
        sdk_out, _ = fb.result(), opt.result()
        our_out = mine.forward_backward([sft_datum(t) for t in TOKENS], "cross_entropy")
        mine.optim_step(AdamParams(**ADAM)).result()
        assert_same_outputs(sdk_out, our_out.result())

    state = tc.save_state("step2").result().path
    assert state == f"tinker://{tc.model_id}/weights/step2"
    resumed = sdk.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.model_id != tc.model_id
    a = tc.forward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    b = resumed.forward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    # the resumed run trains on (its SDK seq ids start again at 1)
    resumed.forward_backward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    resumed.optim_step(tt.AdamParams(**ADAM)).result()
    resumed.load_state(state).result()  # back to step 2, on the run itself
    assert resumed.forward([sdk_datum(t) for t in TOKENS], "cross_entropy").result().metrics["loss:sum"] == a.metrics["loss:sum"]

    rest = sdk_rest(gw_stack)
    ids = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert ids == ["weights/step2"]
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == tiny_model_dir and run.lora_rank == 4 and run.last_checkpoint.tinker_path == state
    listed = rest.list_training_runs(limit=100).result()
    assert {tc.model_id, resumed.model_id} <= {r.training_run_id for r in listed.training_runs}
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.base_model == tiny_model_dir and info.lora_rank == 4
    rest.publish_checkpoint_from_tinker_path(state).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].public
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].expires_at is not None
    assert state in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


def test_sampling_and_logprobs(sdk, ours, tiny_model_dir):
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=4).result()
    tc.forward_backward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    path = tc.save_weights_for_sampler("w1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/w1"
    sc = sdk.create_sampling_client(model_path=path).result()
    assert sc.get_base_model() == tiny_model_dir
    prompt = TOKENS[0]
    params = dict(max_tokens=5, temperature=0.7, seed=1)
    got = sc.sample(tt.ModelInput.from_ints(prompt), num_samples=2, sampling_params=tt.SamplingParams(**params)).result()
    mine = ours.create_sampling_client(model_path=path)
    want = mine.sample(ModelInput.from_ints(prompt), num_samples=2, sampling_params=SamplingParams(**params)).result()
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]
    assert len({s.sequence_id for s in got.sequences}) == 2

    logprobs = sc.compute_logprobs(tt.ModelInput.from_ints(prompt)).result()
    same = mine.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True).result()
    assert logprobs[0] is None and logprobs == same.prompt_logprobs
    np.testing.assert_allclose(logprobs[1:], mine.compute_logprobs(ModelInput.from_ints(prompt)).result()[1:], rtol=1e-5, atol=1e-6)

    snapshot = tc.save_weights_and_get_sampling_client().result()  # ephemeral: unlisted
    again = snapshot.sample(tt.ModelInput.from_ints(prompt), num_samples=2, sampling_params=tt.SamplingParams(**params)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in got.sequences]
    base = sdk.create_sampling_client(base_model=tiny_model_dir).result()
    assert len(base.sample(tt.ModelInput.from_ints(prompt), 1, tt.SamplingParams(max_tokens=3, stop=[])).result().sequences[0].tokens) == 3


def test_prompt_topk_logprobs_last_n_and_sequence_ids(sdk, ours, tiny_model_dir):
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=7).result()
    tc.forward_backward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    path = tc.save_weights_for_sampler("topk").result().path
    sc = sdk.create_sampling_client(model_path=path, record_stability_info=True).result()
    mine = ours.create_sampling_client(model_path=path, record_stability_info=True)
    prompt, k, n = TOKENS[1], 4, 3
    params = dict(max_tokens=2, temperature=0.0)
    got = sc.sample(tt.ModelInput.from_ints(prompt), 2, tt.SamplingParams(**params), include_prompt_logprobs=True,
                    topk_prompt_logprobs=k).result()
    want = mine.sample(ModelInput.from_ints(prompt), 2, SamplingParams(**params), include_prompt_logprobs=True,
                       topk_prompt_logprobs=k).result()
    assert got.topk_prompt_logprobs_np.token_ids.shape == (len(prompt), k)
    assert got.topk_prompt_logprobs[0] is None and want.topk_prompt_logprobs[0] is None
    assert got.topk_prompt_logprobs == want.topk_prompt_logprobs
    whole = sc.compute_logprobs(tt.ModelInput.from_ints(prompt)).result()
    for row, own, token in zip(got.topk_prompt_logprobs[1:], whole[1:], prompt[1:]):
        assert len(row) == k and [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
        assert row[0][1] >= own - 1e-6 and all(lp == pytest.approx(own, abs=1e-5) for t, lp in row if t == token)
    ids = [s.sequence_id for s in got.sequences]
    assert len(set(ids)) == 2 and all(ids) and len({s.sequence_id for s in want.sequences}) == 2

    last = sc.sample(tt.ModelInput.from_ints(prompt), 1, tt.SamplingParams(**params), include_prompt_logprobs=True,
                     topk_prompt_logprobs=k, prompt_logprobs_last_n=n).result()
    cut = len(prompt) - n
    assert last.prompt_logprobs[:cut] == [None] * cut and last.topk_prompt_logprobs[:cut] == [None] * cut
    np.testing.assert_allclose(last.prompt_logprobs[cut:], whole[cut:], atol=1e-6)
    assert last.topk_prompt_logprobs[cut:] == got.topk_prompt_logprobs[cut:]
    assert sc.compute_logprobs(tt.ModelInput.from_ints(prompt), prompt_logprobs_last_n=n).result()[:cut] == [None] * cut
    ours_last = mine.compute_logprobs(ModelInput.from_ints(prompt), prompt_logprobs_last_n=n).result()
    assert ours_last[:cut] == [None] * cut
    np.testing.assert_allclose(ours_last[cut:], last.prompt_logprobs[cut:], rtol=1e-5, atol=1e-6)

    for bad, match in [(dict(topk_prompt_logprobs=21), "topk_prompt_logprobs"),
                       (dict(include_prompt_logprobs=True, prompt_logprobs_last_n=len(prompt)), "prompt_logprobs_last_n")]:
        with pytest.raises(Exception, match=match):
            sc.sample(tt.ModelInput.from_ints(prompt), 1, tt.SamplingParams(**params), **bad).result()
        with pytest.raises(Exception, match=match):
            mine.sample(ModelInput.from_ints(prompt), 1, SamplingParams(**params), **bad).result()


def test_rl_step_and_custom_loss(sdk, ours, tiny_model_dir):
    import torch

    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=5).result()
    mine = ours.create_lora_training_client(tiny_model_dir, rank=4, seed=5)
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = TOKENS[1]
    out = sc.sample(tt.ModelInput.from_ints(prompt), 2, tt.SamplingParams(max_tokens=4, seed=2, stop=[])).result()
    sdk_data, our_data = [], []
    for i, seq in enumerate(out.sequences):
        tokens = prompt + seq.tokens
        n = len(tokens) - 1
        q = np.zeros(n, np.float32)
        q[len(prompt) - 1:] = seq.logprobs
        adv = np.zeros(n, np.float32)
        adv[len(prompt) - 1:] = 1.0 if i == 0 else -1.0
        inputs = {"target_tokens": np.asarray(tokens[1:], np.int64), "logprobs": q, "advantages": adv}
        sdk_data.append(sdk_datum(tokens, **inputs))
        our_data.append(_our_datum(tokens, inputs))
    got = tc.forward_backward(sdk_data, "importance_sampling").result()
    want = mine.forward_backward(our_data, "importance_sampling").result()
    assert_same_outputs(got, want)
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    mine.optim_step(AdamParams(**ADAM)).result()

    def loss_fn(data, logprobs):
        loss = sum((-(lp ** 2)).sum() * 0.01 for lp in logprobs)
        return loss, {"custom:sum": float(loss.detach())}

    got = tc.forward_backward_custom([sdk_datum(t) for t in TOKENS], loss_fn).result()
    want = mine.forward_backward_custom([sft_datum(t) for t in TOKENS], loss_fn).result()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
    assert torch.isfinite(torch.tensor(got.metrics["loss:sum"]))


def _our_datum(tokens, inputs):
    from temper.client import Datum

    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def test_errors_reach_the_sdk(sdk, gw_stack, tiny_model_dir):
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=6).result()
    bad = sdk_datum(TOKENS[0], target_tokens=np.asarray([10**6] * 6, np.int64), weights=np.ones(6, np.float32))
    with pytest.raises(tinker.RequestFailedError, match="INVALID_ARGUMENT"):
        tc.forward_backward([bad], "cross_entropy").result()
    tc.forward_backward([sdk_datum(TOKENS[0])], "cross_entropy").result()  # the refused seq held nothing up
    with pytest.raises(tinker.RequestFailedError, match="dimuon.*not supported"):  # non-Adam: a clear error, the seq spent
        tc.optim_step(tt.DimuonParams(learning_rate=1e-3)).result()
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    with pytest.raises(tinker.BadRequestError, match="dimuon.*not supported"):
        sdk.create_lora_training_client(tiny_model_dir, rank=4, optimizer=tt.DimuonOptimizerConfig()).result()
    with pytest.raises(Exception, match="not found|NOT_FOUND|unknown"):
        sdk.create_lora_training_client("no/such-model", rank=4).result()
    started = time.monotonic()
    with pytest.raises(tinker.NotFoundError, match="not found"):  # a missing session: at once, not retried
        sdk_rest(gw_stack).get_session("no-such-session").result()
    assert time.monotonic() - started < 10


def test_run_metadata_listing_overwrite_and_published_resume(sdk, gw_stack, tiny_model_dir, monkeypatch):
    """Run metadata and owner, runs listed newest first, save_state(overwrite=True, user_metadata=...),
    runs from a checkpoint in a row (ids and seq ids as the SDK computes them), GET /samplers/{id},
    and another tenant's published checkpoint: weights info and a training client from it."""
    rest = sdk_rest(gw_stack)
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=8, user_metadata={"renderer": "llama3"}).result()
    run = rest.get_training_run(tc.model_id).result()
    assert run.user_metadata == {"renderer": "llama3"} and run.model_owner == "local"
    tc.forward_backward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    state = tc.save_state("meta", user_metadata={"step": "1"}).result().path
    with pytest.raises(tinker.RequestFailedError, match="ALREADY_EXISTS|already exists"):
        tc.save_state("meta").result()
    assert tc.save_state("meta", overwrite=True, user_metadata={"step": "2"}).result().path == state
    [listed] = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert listed.tinker_path == state and listed.user_metadata == {"step": "2"}

    first = sdk.create_training_client_from_state_with_optimizer(state).result()
    second = sdk.create_training_client_from_state(state).result()
    a = first.forward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    b = second.forward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"] == tc.forward([sdk_datum(t) for t in TOKENS], "cross_entropy").result().metrics["loss:sum"]
    runs = rest.list_training_runs(limit=3).result().training_runs
    assert [r.training_run_id for r in runs] == [second.model_id, first.model_id, tc.model_id]  # newest first

    sc = tc.save_weights_and_get_sampling_client().result()
    sampler = rest.get_sampler(sc._sampling_session_id).result()
    assert sampler.base_model == tiny_model_dir

    monkeypatch.setenv("TINKER_API_KEY", gw_stack.key_for("sdk-other"))
    other = tinker.ServiceClient()
    try:
        other_rest = sdk_rest(gw_stack, gw_stack.key_for("sdk-other"))
        with pytest.raises(tinker.NotFoundError):
            other_rest.get_weights_info_by_tinker_path(state).result()
        rest.publish_checkpoint_from_tinker_path(state).result()
        info = other_rest.get_weights_info_by_tinker_path(state).result()
        assert info.base_model == tiny_model_dir and info.lora_rank == 4
        theirs = other.create_training_client_from_state(state).result()
        got = theirs.forward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
        assert got.metrics["loss:sum"] == a.metrics["loss:sum"]
        theirs.forward_backward([sdk_datum(t) for t in TOKENS], "cross_entropy").result()
        theirs.optim_step(tt.AdamParams(**ADAM)).result()
        with pytest.raises(tinker.NotFoundError):
            other_rest.get_training_run(tc.model_id).result()
    finally:
        other.close("success")


def test_search_checkpoints_and_base_model(sdk, ours, gw_stack, tiny_model_dir):
    """Tinker 0.39's RestClient.search_checkpoints: POST /api/v1/checkpoints/search with its
    CheckpointSearchRequest body (sent here as 0.39 sends it when the installed SDK predates it), the
    caller's checkpoints only, cursor paging; Checkpoint.base_model; temper.client's search_checkpoints
    answers the same; the sessions search route answers 404 at once."""
    import uuid

    import httpx

    from temper.client import types as t

    tag = uuid.uuid4().hex
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=11).result()
    saved = [tc.save_state("s1", user_metadata={"search": tag, "n": "1"}).result().path,
             tc.save_weights_for_sampler("s2", user_metadata={"search": tag, "n": "2"}).result().path,
             tc.save_state("s3", user_metadata={"search": tag, "n": "3"}).result().path]
    newest_first = saved[::-1]

    def search(body, key=gw_stack.api_key, status=200):
        r = httpx.post(f"{gw_stack.gateway_url}/api/v1/checkpoints/search", json=body, headers={"X-API-Key": key}, timeout=30)
        assert r.status_code == status, r.text
        return r.json()

    first = search({"user_metadata": {"search": tag}, "owner": {"type": "own"}, "limit": 2})
    assert [c["tinker_path"] for c in first["checkpoints"]] == newest_first[:2]
    assert all(c["base_model"] == tiny_model_dir for c in first["checkpoints"])  # Checkpoint.base_model (0.39)
    assert set(first["next_cursor"]) == {"last_created_at", "last_checkpoint_uuid"}
    rest_page = search({"user_metadata": {"search": tag}, "limit": 2, "cursor": first["next_cursor"]})
    assert [c["tinker_path"] for c in rest_page["checkpoints"]] == newest_first[2:] and rest_page["next_cursor"] is None
    parsed = [tt.Checkpoint.model_validate(c) for c in first["checkpoints"] + rest_page["checkpoints"]]  # the SDK's type
    assert [c.tinker_path for c in parsed] == newest_first

    only_sampler = search({"user_metadata": {"search": tag}, "checkpoint_type": "sampler"})["checkpoints"]
    assert [c["tinker_path"] for c in only_sampler] == [saved[1]]
    assert [c["tinker_path"] for c in search({"user_metadata": {"search": tag, "n": "3"}})["checkpoints"]] == [saved[2]]
    assert search({"user_metadata": {"search": tag}, "base_models": ["no/such-model"]})["checkpoints"] == []
    assert len(search({"user_metadata": {"search": tag}, "base_models": [tiny_model_dir]})["checkpoints"]) == 3
    assert len(search({"user_metadata": {"search": tag}, "owner": {"type": "user", "owner_urns": ["local"]}})["checkpoints"]) == 3
    assert search({"user_metadata": {"search": tag}, "owner": {"type": "user", "owner_urns": ["sdk-other"]}})["checkpoints"] == []
    assert "not found" in str(search({"project_ids": ["p1"]}, status=404))  # not one of the caller's projects
    assert "limit" in str(search({"limit": 500}, status=400))
    # another tenant never sees them, published or not
    rest = sdk_rest(gw_stack)
    rest.publish_checkpoint_from_tinker_path(saved[0]).result()
    other = search({"user_metadata": {"search": tag}, "owner": {"type": "accessible"}}, key=gw_stack.key_for("sdk-other"))
    assert other == {"checkpoints": [], "next_cursor": None}

    if hasattr(rest, "search_checkpoints"):  # SDK 0.39+
        page = rest.search_checkpoints(tt.CheckpointSearchRequest(user_metadata={"search": tag}, limit=2)).result()
        assert [c.tinker_path for c in page.checkpoints] == newest_first[:2] and page.checkpoints[0].base_model == tiny_model_dir
        assert page.next_cursor is not None

    our_rest = ours.create_rest_client()
    request = t.CheckpointSearchRequest(user_metadata={"search": tag}, limit=2)
    page = our_rest.search_checkpoints(request).result()
    assert [c.tinker_path for c in page.checkpoints] == newest_first[:2]
    assert page.checkpoints[0].base_model == tiny_model_dir and page.next_cursor is not None
    page2 = our_rest.search_checkpoints(request.model_copy(update={"cursor": page.next_cursor})).result()
    assert [c.tinker_path for c in page2.checkpoints] == newest_first[2:] and page2.next_cursor is None
    with pytest.raises(NotFound, match="not found"):
        our_rest.search_checkpoints(t.CheckpointSearchRequest(project_ids=["p1"])).result()

    # list_sessions and get_session: tests/stack/test_records_api.py; search_sessions and projects:
    # tests/stack/test_sdk_sessions_projects.py
