"""Streaming that really streams, end to end (sampler -> scheduler -> gateway -> client), and the
last OpenAI / Anthropic routes, on the tiny model. The sampler here is the real one with each decode
step slowed and the end of each batch's decode written down (SLOW_SAMPLER), so the order of events
can be compared: the first SSE chunk arrives before the sampler has finished decoding. Streamed text
equals the non-streamed text for the same seed (OpenAI completions and chat, Anthropic messages);
models.retrieve; SampleStream's bad input through the raw stub is INVALID_ARGUMENT and changes nothing."""

import json
import sys
import time

import grpc
import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")  # the `gateway` test extra (make venv installs both)
anthropic = pytest.importorskip("anthropic")

from temper.common.codec import decode_floats, encode_tokens  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2  # noqa: E402

STEP_SECONDS = 0.05
SLOW_SAMPLER = """
import pathlib, time, temper.services.sampler.torch_backend as tb
log, choose, sample_batch = pathlib.Path({log!r}), tb._choose, tb.TorchSamplerBackend.sample_batch
def slow_choose(*args, **kwargs):
    time.sleep({step})
    return choose(*args, **kwargs)
def recorded(self, requests):
    try:
        return sample_batch(self, requests)
    finally:
        with log.open("a") as f:
            f.write(f"{{time.time()!r}}\\n")  # when this batch's decode ended
tb._choose, tb.TorchSamplerBackend.sample_batch = slow_choose, recorded
from temper.services.sampler.__main__ import main
main()
"""
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Which attempt is better?"}]


@pytest.fixture(scope="module")
def slow(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_streaming")
    data = tmp_path_factory.mktemp("streaming")
    with LocalStack(tiny_model_dir, data, database_url=url, num_threads=1, gateway=True) as local:
        local.start()
        local.decode_log = data / "decode-ends.log"
        local.restart("sampler", argv=[sys.executable, "-c", SLOW_SAMPLER.format(log=str(local.decode_log), step=STEP_SECONDS)],
                      timeout=120)
        yield local


@pytest.fixture(scope="module")
def oa(slow):
    client = openai.OpenAI(base_url=f"{slow.gateway_url}/v1", api_key=slow.api_key, max_retries=2, timeout=120)
    yield client
    client.close()


def sse_events(slow, path: str, body: dict) -> list[tuple[float, str]]:
    """(arrival time, data) of each server-sent event, read as it arrives."""
    out = []
    with httpx.stream("POST", f"{slow.gateway_url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {slow.api_key}"}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out.append((time.time(), line[len("data: "):]))
    return out


def decode_ends(slow) -> list[float]:
    return [float(x) for x in slow.decode_log.read_text().split()] if slow.decode_log.exists() else []


def test_the_first_chunk_arrives_before_sampling_ends(slow, oa, tiny_model_dir):
    body = {"model": tiny_model_dir, "prompt": "The quick brown", "max_tokens": 24, "temperature": 0.9, "seed": 7}
    plain = oa.completions.create(**body)
    assert plain.usage.completion_tokens >= 8  # long enough for the order below to mean something
    before = len(decode_ends(slow))
    events = sse_events(slow, "/v1/completions", {**body, "stream": True})
    ends = decode_ends(slow)[before:]
    assert len(ends) == 1  # this request's decode
    chunks = [(at, json.loads(data)) for at, data in events if data != "[DONE]"]
    assert events[-1][1] == "[DONE]" and len(chunks) >= 4  # token by token, not one chunk
    assert chunks[0][0] < ends[0], "the first chunk came only after sampling ended"
    # as decoded, not in a burst at the end: at least the first half of the chunks came while the sampler was still
    # decoding (each had half the decode's slowed steps still to run; the last chunk itself may well arrive before the
    # sampler's batch call has returned and its end is written, so no order is asserted for it)
    assert sum(at < ends[0] for at, _ in chunks) >= len(chunks) // 2
    assert "".join(c["choices"][0]["text"] for _, c in chunks) == plain.choices[0].text
    assert chunks[-1][1]["choices"][0]["finish_reason"] == plain.choices[0].finish_reason


def test_streamed_chat_equals_the_non_streamed_answer(oa, tiny_model_dir):
    params = dict(model=tiny_model_dir, messages=MESSAGES, max_tokens=10, temperature=0.8, seed=3, n=2)
    plain = oa.chat.completions.create(**params, logprobs=True, top_logprobs=1)
    chunks = list(oa.chat.completions.create(**params, logprobs=True, top_logprobs=1, stream=True,
                                             stream_options={"include_usage": True}))
    for j, choice in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [t.logprob for c in mine if c.logprobs for t in c.logprobs.content] == [
            t.logprob for t in choice.logprobs.content]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # stop strings: the streamed text is cut where the non-streamed one is, the stop string left out
    text = plain.choices[0].message.content
    if len(text) > 3:
        stop = text[2:4]
        cut = oa.chat.completions.create(**{**params, "n": 1}, stop=[stop])
        streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
            **{**params, "n": 1}, stop=[stop], stream=True) if c.choices)
        assert streamed == cut.choices[0].message.content and stop not in streamed


def test_models_retrieve(oa, slow, tiny_model_dir):
    got = oa.models.retrieve(tiny_model_dir)
    assert got.id == tiny_model_dir and got.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        oa.models.retrieve("no/such-model")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        oa.models.retrieve("tinker://nope:train:0/sampler_weights/x")
    assert err.value.code == "model_not_found"
    resp = httpx.get(f"{slow.gateway_url}/v1/models/{tiny_model_dir}", headers={"Authorization": "Bearer tml-not-a-key"})
    assert resp.status_code == 401 and set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_anthropic_messages_streamed_and_not(slow, tiny_model_dir):
    client = anthropic.Anthropic(base_url=slow.gateway_url, api_key=slow.api_key, max_retries=2, timeout=120)
    # greedy (Anthropic's API has no seed; this SDK sends temperature only as an extra field)
    params = dict(model=tiny_model_dir, max_tokens=10, system="Answer briefly.", extra_body={"temperature": 0.0},
                  messages=[{"role": "user", "content": "Which attempt is better?"}])
    plain = client.messages.create(**params)
    assert plain.role == "assistant" and plain.content[0].type == "text"
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.usage.output_tokens >= 1
    with client.messages.stream(**params) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == plain.content[0].text and final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    text = plain.content[0].text
    if len(text) > 3:
        cut = client.messages.create(**params, stop_sequences=[text[1:3]])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == text[1:3]
        assert cut.content[0].text == text[:text.find(text[1:3])]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=slow.gateway_url, api_key="tml-not-a-key", max_retries=0).messages.create(**params)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**params, "model": "no/such-model"})
    client.close()


def test_sample_stream_through_the_raw_stub(slow, tiny_model_dir):
    meta = (("authorization", f"Bearer {slow.api_key}"),)
    with grpc.insecure_channel(slow.service("scheduler").address) as channel:
        stub = service_pb2_grpc.TemperStub(channel)
        session = stub.CreateSession(service_pb2.CreateSessionRequest(), metadata=meta).session_id
        sampler = stub.CreateSamplingClient(service_pb2.CreateSamplingClientRequest(session_id=session,
                                                                                    base_model=tiny_model_dir), metadata=meta)
        prompt = types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(
            encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens([5, 17, 42, 99])))])
        good = service_pb2.SampleRequest(sampler_id=sampler.sampler_id, prompt=prompt, num_samples=2, topk_logprobs=1,
                                         sampling_params=types_pb2.SamplingParams(max_tokens=6, temperature=0.9, seed=5))
        usage = stub.GetUsage(service_pb2.GetUsageRequest(), metadata=meta).tokens_sampled
        for change, code in [(dict(num_samples=0), grpc.StatusCode.INVALID_ARGUMENT),
                             (dict(topk_logprobs=-1), grpc.StatusCode.INVALID_ARGUMENT),
                             (dict(request_tag="no spaces"), grpc.StatusCode.INVALID_ARGUMENT),
                             (dict(prompt=types_pb2.ModelInput()), grpc.StatusCode.INVALID_ARGUMENT),
                             (dict(sampler_id="nope"), grpc.StatusCode.NOT_FOUND)]:
            bad = service_pb2.SampleRequest()
            bad.CopyFrom(good)
            for name, value in change.items():
                if isinstance(value, types_pb2.ModelInput):
                    getattr(bad, name).CopyFrom(value)
                else:
                    setattr(bad, name, value)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.SampleStream(bad, metadata=meta))
            assert err.value.code() == code, (change, err.value.details())
        bad = service_pb2.SampleRequest()
        bad.CopyFrom(good)
        bad.sampling_params.temperature = -1.0
        with pytest.raises(grpc.RpcError) as err:
            list(stub.SampleStream(bad, metadata=meta))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
        assert stub.GetUsage(service_pb2.GetUsageRequest(), metadata=meta).tokens_sampled == usage  # nothing sampled

        chunks = list(stub.SampleStream(good, metadata=meta))
        whole = stub.Sample(good, metadata=meta)
        assert chunks[-1].done and all(not c.done for c in chunks[:-1])
        for i, seq in enumerate(whole.sequences):
            mine = [p for c in chunks for p in c.pieces if p.index == i]
            assert b"".join(p.tokens for p in mine) == seq.tokens
            np.testing.assert_array_equal(np.concatenate([decode_floats(p.logprobs) for p in mine]), decode_floats(seq.logprobs))
            assert mine[-1].stop_reason == seq.stop_reason and mine[0].sequence_id.startswith(f"{sampler.sampler_id}:")
        generated = sum(len(s.tokens) // 4 for s in whole.sequences)
        assert stub.GetUsage(service_pb2.GetUsageRequest(), metadata=meta).tokens_sampled == usage + 2 * generated


def test_prompt_cache_hits_reach_the_client_and_the_gateway_json(slow, tiny_model_dir):
    """The same prompt twice from one sampling client: the second reuses the whole prompt (a full hit in
    the sampler's prefix cache), reported through temper.client and the gateway's JSON, the same bits."""
    from temper.client import ModelInput, SamplingParams

    tokens, params = [5, 17, 42, 99, 7, 8], dict(max_tokens=4, temperature=0.9, seed=11)
    client = slow.client()
    try:
        sc = client.create_sampling_client(base_model=tiny_model_dir)
        first, again = (sc.sample(ModelInput.from_ints(tokens), num_samples=2, sampling_params=SamplingParams(**params)).result()
                        for _ in range(2))
    finally:
        client.close()
    assert (first.prompt_cache_hit_tokens, again.prompt_cache_hit_tokens) == (0, len(tokens))
    assert [(s.tokens, list(s.logprobs)) for s in again.sequences] == [(s.tokens, list(s.logprobs)) for s in first.sequences]

    headers, url = {"X-API-Key": slow.api_key}, slow.gateway_url
    session = httpx.post(f"{url}/api/v1/create_session", headers=headers, timeout=60,
                         json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    sampler = httpx.post(f"{url}/api/v1/create_sampling_session", headers=headers, timeout=60, json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": tiny_model_dir}).json()["sampling_session_id"]
    hits = []
    for _ in range(2):
        future = httpx.post(f"{url}/api/v1/asample", headers=headers, timeout=60, json={
            "sampling_session_id": sampler, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": params}).json()["request_id"]
        body = {"type": "try_again"}
        while body.get("type") == "try_again":
            body = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, timeout=120, json={"request_id": future}).json()
        hits.append(body["prompt_cache_hit_tokens"])
    assert hits == [0, len(tokens)]
