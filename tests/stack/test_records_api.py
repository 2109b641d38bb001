"""The records kept after an answer, through the real stack (scheduler on Postgres, trainer, sampler,
gateway): ListRunMetrics rows equal what the verbs answered (loss, metrics, tokens, grad norm,
learning rate), with steps, timing and the trainer; step ranges and pages; sessions and their
sampling records and buckets; another tenant's ids NOT_FOUND with a missing id's text; bad ranges
and pages INVALID_ARGUMENT with nothing written; and the SDK routes (list_sessions, get_session,
AdminClient.get_current_checkpoint_storage_usage, /api/v1/whoami) with the real tinker SDK."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
import tinker
from sqlalchemy import create_engine, text

from fixtures_stack import keyed_channel, sft_datum
from temper.client import AdamParams, convert
from temper.localstack import LocalStack
from temper.v1 import records_pb2, service_pb2, service_pb2_grpc, types_pb2

TOKENS = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64]
LORA = types_pb2.LoraConfig(rank=4, alpha=8.0, seed=3, train_attn=True, train_mlp=True, train_unembed=False)
ADAM = convert.adam_to_proto(AdamParams(learning_rate=1e-2))


@pytest.fixture(scope="module")
def gw(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_records")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("records"), database_url=url, num_threads=1, gateway=True) as local:
        local.address = local.start()
        local.url = url
        yield local


def stub(stack, tenant: str) -> service_pb2_grpc.TemperStub:
    return service_pb2_grpc.TemperStub(keyed_channel(stack, tenant))


def refused(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request)
    return caught.value.code(), caught.value.details()


def count_rows(url: str, table: str) -> int:
    engine = create_engine(url)
    with engine.connect() as conn:
        n = conn.execute(text(f"select count(*) from {table}")).scalar()
    engine.dispose()
    return n


def fb(s, run_id, seq, forward_only=False):
    return s.ForwardBackward(service_pb2.ForwardBackwardRequest(
        training_run_id=run_id, seq_id=seq, data=[convert.datum_to_proto(sft_datum(TOKENS))], loss_fn="cross_entropy",
        forward_only=forward_only))


def test_run_metrics_equal_the_answers_paged_and_ranged(gw, tiny_model_dir):
    s = stub(gw, "rec-a")
    sid = s.CreateSession(service_pb2.CreateSessionRequest()).session_id
    run_id = s.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=sid, base_model=tiny_model_dir,
                                                                      lora_config=LORA)).training_run_id
    answers = [fb(s, run_id, 1), s.OptimStep(service_pb2.OptimStepRequest(training_run_id=run_id, seq_id=2, adam_params=ADAM)),
               fb(s, run_id, 3, forward_only=True), fb(s, run_id, 4),
               s.OptimStep(service_pb2.OptimStepRequest(training_run_id=run_id, seq_id=5, adam_params=ADAM))]
    s.SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=run_id, seq_id=6, name="w", kind=types_pb2.CHECKPOINT_KIND_SAMPLER))
    rows = list(s.ListRunMetrics(records_pb2.ListRunMetricsRequest(training_run_id=run_id)).metrics)
    assert [(r.seq_id, r.kind, r.status, r.step) for r in rows] == [
        (1, "forward_backward", "done", 0), (2, "optim_step", "done", 1), (3, "forward", "done", 1),
        (4, "forward_backward", "done", 1), (5, "optim_step", "done", 2), (6, "save_weights", "done", 2)]
    for row, answer in zip(rows, answers):
        assert dict(row.metrics) == dict(answer.metrics)  # exactly what the verb answered
    for i in (0, 2, 3):
        assert row_loss(rows[i]) == answers[i].metrics["loss:sum"] and rows[i].num_tokens == len(TOKENS) - 1
    for i in (1, 4):
        assert rows[i].grad_norm == answers[i].metrics["grad_norm:mean"] > 0 and rows[i].learning_rate == pytest.approx(1e-2)
        assert not rows[i].HasField("loss")
    assert rows[3].metrics["loss:sum"] < rows[0].metrics["loss:sum"]  # the step trained
    trainer = gw.service("trainer").address
    for r in rows:
        assert r.trainer.endswith(trainer.rsplit(":", 1)[1]) and r.cycle > 0 and r.cobatched_with == 0
        assert 0 < r.created_unix_ms <= r.started_unix_ms <= r.answered_unix_ms <= time.time() * 1000
        assert r.queued_seconds == pytest.approx((r.started_unix_ms - r.created_unix_ms) / 1000)
        assert r.trainer_seconds == pytest.approx((r.answered_unix_ms - r.started_unix_ms) / 1000)

    paged, token = [], ""
    while True:
        page = s.ListRunMetrics(records_pb2.ListRunMetricsRequest(training_run_id=run_id, page_size=4, page_token=token))
        paged += page.metrics
        token = page.next_page_token
        if not token:
            break
    assert paged == rows
    ranged = s.ListRunMetrics(records_pb2.ListRunMetricsRequest(training_run_id=run_id, from_step=1, to_step=1)).metrics
    assert [r.seq_id for r in ranged] == [2, 3, 4]
    assert [r.seq_id for r in s.ListRunMetrics(records_pb2.ListRunMetricsRequest(training_run_id=run_id, from_step=2)).metrics] == [5, 6]

    # another tenant's run is a missing one; bad ranges and pages are refused; nothing is written
    before = count_rows(gw.url, "run_metrics")
    missing = refused(s.ListRunMetrics, records_pb2.ListRunMetricsRequest(training_run_id="nope:train:0"))
    theirs = refused(stub(gw, "rec-b").ListRunMetrics, records_pb2.ListRunMetricsRequest(training_run_id=run_id))
    assert missing[0] == theirs[0] == grpc.StatusCode.NOT_FOUND
    assert theirs[1] == missing[1].replace("nope:train:0", run_id)
    for bad in (dict(from_step=-1), dict(from_step=3, to_step=2), dict(to_step=-1), dict(page_size=1001), dict(page_size=-1),
                dict(page_size=2**31 - 1), dict(page_token="abc"), dict(page_token="1" * 40)):
        code, _ = refused(s.ListRunMetrics, records_pb2.ListRunMetricsRequest(training_run_id=run_id, **bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert count_rows(gw.url, "run_metrics") == before


def row_loss(row: records_pb2.RunMetric) -> float:
    assert row.HasField("loss")
    return row.loss


def test_sessions_and_their_sampling_records(gw, tiny_model_dir):
    s, other = stub(gw, "rec-c"), stub(gw, "rec-d")
    sid = s.CreateSession(service_pb2.CreateSessionRequest(tags=["t1"], user_metadata={"k": "v"})).session_id
    run_id = s.CreateTrainingRun(service_pb2.CreateTrainingRunRequest(session_id=sid, base_model=tiny_model_dir,
                                                                      lora_config=LORA)).training_run_id
    sampler = s.CreateSamplingClient(service_pb2.CreateSamplingClientRequest(session_id=sid, base_model=tiny_model_dir)).sampler_id
    prompt = convert.model_input_to_proto(sft_datum(TOKENS).model_input)
    began = int(time.time() * 1000)
    samples = [s.Sample(service_pb2.SampleRequest(sampler_id=sampler, prompt=prompt, num_samples=n,
                                                  sampling_params=types_pb2.SamplingParams(max_tokens=4, seed=n)))
               for n in (2, 1)]
    s.ComputeLogprobs(service_pb2.ComputeLogprobsRequest(sampler_id=sampler, prompt=prompt))
    generated = [sum(len(q.tokens) // 4 for q in r.sequences) for r in samples]
    prompt_len = len(TOKENS) - 1

    info = s.GetSession(records_pb2.GetSessionRequest(session_id=sid))
    assert list(info.training_run_ids) == [run_id] and list(info.sampler_ids) == [sampler]
    assert list(info.tags) == ["t1"] and dict(info.user_metadata) == {"k": "v"} and not info.closed
    assert (info.sample_requests, info.prompt_tokens, info.tokens_sampled) == (3, 3 * prompt_len, sum(generated))
    listed = s.ListSessions(records_pb2.ListSessionsRequest())
    assert listed.sessions[0].session_id == sid and listed.total_count >= 1
    assert sid not in [x.session_id for x in other.ListSessions(records_pb2.ListSessionsRequest(limit=1000)).sessions]

    asked = dict(session_id=sid, from_unix_ms=began - 1000)
    records = s.GetSessionSamplingMetrics(records_pb2.GetSessionSamplingMetricsRequest(**asked)).records
    assert [(r.kind, r.num_samples, r.prompt_tokens, r.tokens_sampled) for r in records] == [
        ("sample", 2, prompt_len, generated[0]), ("sample", 1, prompt_len, generated[1]), ("compute_logprobs", 0, prompt_len, 0)]
    assert all(began <= r.started_unix_ms <= r.answered_unix_ms for r in records) and {r.sampler_id for r in records} == {sampler}
    first = s.GetSessionSamplingMetrics(records_pb2.GetSessionSamplingMetricsRequest(**asked, page_size=2))
    rest = s.GetSessionSamplingMetrics(records_pb2.GetSessionSamplingMetricsRequest(**asked, page_size=2,
                                                                                    page_token=first.next_page_token))
    assert list(first.records) + list(rest.records) == list(records) and not rest.next_page_token
    buckets = s.GetSessionSamplingMetrics(records_pb2.GetSessionSamplingMetricsRequest(**asked, bucket_seconds=3600)).buckets
    assert len(buckets) == 1 and (buckets[0].requests, buckets[0].prompt_tokens, buckets[0].tokens_sampled) == (
        3, 3 * prompt_len, sum(generated))
    assert buckets[0].start_unix_ms == began - 1000 and buckets[0].busy_seconds == pytest.approx(
        sum(r.answered_unix_ms - r.started_unix_ms for r in records) / 1000)
    closed = s.CloseSession(service_pb2.CloseSessionRequest(session_id=sid, status="errored"))
    assert closed is not None
    info = s.GetSession(records_pb2.GetSessionRequest(session_id=sid))
    assert info.closed and info.close_status == "errored" and info.closed_unix_ms >= info.created_unix_ms

    before = count_rows(gw.url, "sampling_records")
    for call, request in ((other.GetSession, records_pb2.GetSessionRequest(session_id=sid)),
                          (other.GetSessionSamplingMetrics, records_pb2.GetSessionSamplingMetricsRequest(session_id=sid))):
        code, message = refused(call, request)
        assert code == grpc.StatusCode.NOT_FOUND and message == f"session {sid!r} not found"
    for bad in (dict(from_unix_ms=-1), dict(from_unix_ms=10, to_unix_ms=10), dict(bucket_seconds=-1),
                dict(from_unix_ms=0, bucket_seconds=1), dict(page_size=5000), dict(page_token="x.1"),
                dict(bucket_seconds=60, page_token="1.1")):
        code, _ = refused(s.GetSessionSamplingMetrics, records_pb2.GetSessionSamplingMetricsRequest(session_id=sid, **bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, bad
    for bad in (dict(limit=1001), dict(limit=-1), dict(offset=-1)):
        assert refused(s.ListSessions, records_pb2.ListSessionsRequest(**bad))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert count_rows(gw.url, "sampling_records") == before


def test_sdk_session_storage_and_whoami_routes(gw, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", gw.gateway_url)
    monkeypatch.setenv("TINKER_API_KEY", gw.api_key)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    sdk = tinker.ServiceClient()
    try:
        tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=5).result()
        sc = tc.save_weights_and_get_sampling_client("rec")  # an unlisted snapshot: in size_bytes, not in the count
        tc.save_weights_for_sampler("rec-sampler").result()
        tc.save_state("rec-state").result()
        session_id = tc.model_id.rsplit(":train:", 1)[0]
        rest = tinker.RestClient(base_url=gw.gateway_url, api_key=gw.api_key)  # explicit: the SDK caches bare RestClient() holders process-wide
        assert session_id in rest.list_sessions(limit=1000).result().sessions
        got = rest.get_session(session_id).result()
        assert tc.model_id in got.training_run_ids and len(got.sampler_ids) >= 1 and sc is not None
        with pytest.raises(tinker.NotFoundError, match="not found"):
            rest.get_session("no-such-session").result()

        headers = {"X-API-Key": gw.api_key}
        other = {"X-API-Key": gw.key_for("rec-sdk-other")}
        assert httpx.get(f"{gw.gateway_url}/api/v1/sessions/{session_id}", headers=other, timeout=30).status_code == 404
        assert session_id not in httpx.get(f"{gw.gateway_url}/api/v1/sessions", params={"limit": 1000}, headers=other,
                                           timeout=30).json()["sessions"]
        for params in ({"limit": "1001"}, {"limit": "-1"}, {"offset": "x"}, {"access_scope": "everyone"}):
            assert httpx.get(f"{gw.gateway_url}/api/v1/sessions", params=params, headers=headers, timeout=30).status_code == 400

        usage = tinker.AdminClient(base_url=gw.gateway_url, api_key=gw.api_key).get_current_checkpoint_storage_usage().result()
        ours = service_pb2_grpc.TemperStub(keyed_channel(gw, "local"))
        scheduler_usage = ours.GetUsage(service_pb2.GetUsageRequest())
        listed = ours.ListCheckpoints(service_pb2.ListCheckpointsRequest()).checkpoints
        assert len(usage.data) == 1 and usage.data[0].size_bytes == scheduler_usage.storage_bytes > 0
        assert usage.data[0].checkpoint_count == len(listed) >= 2 and usage.data[0].user_name == scheduler_usage.tenant
        r = httpx.get(f"{gw.gateway_url}/api/v1/billing/usage/checkpoints/current", params={"project_id": "p"}, headers=headers,
                      timeout=30)
        assert r.status_code == 404 and "not found" in r.text  # not one of the caller's projects

        me = httpx.get(f"{gw.gateway_url}/api/v1/whoami", headers=headers, timeout=30).json()
        assert me["org_urn"] == f"temper:tenant:{scheduler_usage.tenant}" and gw.api_key.startswith(me["key_prefix"])
        assert me["user_urn"] == f"temper:key:{me['key_prefix']}" and me["email"] is None
        assert httpx.get(f"{gw.gateway_url}/api/v1/whoami", headers={"X-API-Key": "tml-not-a-key"}, timeout=30).status_code == 401
    finally:
        sdk.close("success")
