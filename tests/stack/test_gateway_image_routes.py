"""Images through a real gateway on the tiny Qwen3-VL stack: OpenAI chat image_url parts and Anthropic
image blocks give exactly what temper.client's Sample gives for the model input they render to (the
template's text with each image in place of its image token); the official Tinker SDK's ImageChunk
samples and trains (protobuf forward_backward) exactly as temper.client does; an image uploaded with
POST /api/v1/images is sampled by pointer; refusals are 400s and leave nothing behind.

The model's VisionInfo in the public API, on the same processes: GetServerCapabilities describes the tiny
Qwen3-VL with the image token ids and image processor its workers read from its folder (and the text-only
tiny model with none); temper.client counts an image's tokens from it exactly as the scheduler counts an
upload's; GetTokenizer's files hold the VL model's preprocessor_config.json (get_tokenizer() folders on
another machine load the image processor too) and no such file for a text-only model. (One stack serves
both: a second start-up of the same model would test nothing more.)"""

import base64
import json

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")  # the `gateway` extra (make venv installs it): missing fails CI's import check
tinker = pytest.importorskip("tinker")

from tinker import types as tt  # noqa: E402

from fixtures_stack import png_bytes, raw_stub  # noqa: E402
from temper.client import EncodedTextChunk, ImageAssetPointerChunk, ImageChunk, ModelInput, SamplingParams  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402
from temper.v1 import service_pb2  # noqa: E402

RED, BLUE = png_bytes("red"), png_bytes("blue", (128, 64), "JPEG")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vl_stack(vl_model_dirs, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_gateway_images")
    with LocalStack(vl_model_dirs["qwen3_vl"], tmp_path_factory.mktemp("gw-images"), database_url=url, num_threads=1,
                    gateway=True) as local:
        local.address = local.start()
        yield local


@pytest.fixture(scope="module")
def model(vl_model_dirs):
    return vl_model_dirs["qwen3_vl"]


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def ours(vl_stack):
    client = vl_stack.client()
    yield client
    client.close()


@pytest.fixture
def sdk(vl_stack, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", vl_stack.gateway_url)
    monkeypatch.setenv("TINKER_API_KEY", vl_stack.api_key)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    client = tinker.ServiceClient()
    yield client
    client.close("success")


def rendered(tokenizer, model_dir, parts, images):
    """The chat's model input built directly: the template's tokens, each image token (the model's, from
    its config) replaced by the image."""
    from transformers import AutoConfig

    image_token = AutoConfig.from_pretrained(model_dir).image_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    chunks, run, images = [], [], iter(images)
    for t in tokenizer.encode(text, add_special_tokens=False):
        if t == image_token:
            chunks += [EncodedTextChunk(tokens=run), next(images)]
            run = []
        else:
            run.append(t)
    return ModelInput(chunks=[*chunks, EncodedTextChunk(tokens=run)])


def test_openai_chat_with_images_equals_sample(vl_stack, ours, model, tokenizer):
    oa = openai.OpenAI(base_url=f"{vl_stack.gateway_url}/v1", api_key=vl_stack.api_key, max_retries=0, timeout=120)
    content = [{"type": "text", "text": "Which colours?"},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(RED)}"}},
               {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{b64(BLUE)}"}}]
    got = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=6, seed=3,
                                     temperature=0.9, logprobs=True)
    prompt = rendered(tokenizer, model, [{"type": "text", "text": "Which colours?"}, {"type": "image"}, {"type": "image"}],
                      [ImageChunk(RED, "png"), ImageChunk(BLUE, "jpeg")])
    want = ours.create_sampling_client(base_model=model).sample(
        prompt, sampling_params=SamplingParams(max_tokens=6, seed=3, temperature=0.9)).result().sequences[0]
    assert [c.logprob for c in got.choices[0].logprobs.content] == want.logprobs
    text_tokens = sum(len(c.tokens) for c in prompt.chunks if isinstance(c, EncodedTextChunk))
    assert got.usage.prompt_tokens == text_tokens + 4 + 8  # 64x64 is 4 image tokens, 128x64 is 8 (the tiny processor)
    streamed = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=6, seed=3,
                                          temperature=0.9, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == got.choices[0].message.content
    # Anthropic's image block, the same image and seed: the same tokens
    resp = httpx.post(f"{vl_stack.gateway_url}/v1/messages", headers={"x-api-key": vl_stack.api_key}, timeout=120, json={
        "model": model, "max_tokens": 6, "temperature": 0.9, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(RED)}}]}]})
    assert resp.status_code == 200, resp.text
    prompt = rendered(tokenizer, model, [{"type": "image"}], [ImageChunk(RED, "png")])
    assert resp.json()["usage"]["input_tokens"] == sum(len(c.tokens) for c in prompt.chunks if isinstance(c, EncodedTextChunk)) + 4
    oa.close()


def test_chat_refusals_are_400(vl_stack, model):
    oa = openai.OpenAI(base_url=f"{vl_stack.gateway_url}/v1", api_key=vl_stack.api_key, max_retries=0, timeout=120)
    for url, words in [("https://example.com/cat.png", "remote image URLs are not fetched; send a data: URL"),
                       (f"data:image/gif;base64,{b64(RED)}", "image/gif"),
                       (f"data:image/png;base64,{b64(RED[:50])}", "corrupt PNG")]:
        with pytest.raises(openai.BadRequestError, match=words):
            oa.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])
    oa.close()


def test_sdk_samples_and_trains_with_images(sdk, ours, model, tokenizer):
    prompt_ids = tokenizer.encode("colour:")
    sdk_input = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=prompt_ids), tt.ImageChunk(data=RED, format="png")])
    our_input = ModelInput(chunks=[EncodedTextChunk(tokens=prompt_ids), ImageChunk(RED, "png")])
    params = dict(max_tokens=5, seed=11, temperature=1.0)
    got = sdk.create_sampling_client(base_model=model).result().sample(sdk_input, 1, tt.SamplingParams(**params)).result()
    want = ours.create_sampling_client(base_model=model).sample(our_input, sampling_params=SamplingParams(**params)).result()
    assert got.sequences[0].tokens == want.sequences[0].tokens and got.sequences[0].logprobs == want.sequences[0].logprobs

    # forward_backward as the SDK sends it (protobuf), the image's 4 tokens counted in the targets
    n = len(prompt_ids) + 4
    targets = np.arange(1, n + 1, dtype=np.int64) % 100 + 5
    datum = tt.Datum(model_input=tt.ModelInput(chunks=[*sdk_input.chunks[:1], tt.ImageChunk(data=RED, format="png",
                                                                                               expected_tokens=4)]),
                     loss_fn_inputs={"target_tokens": targets, "weights": np.ones(n, np.float32)})
    tc = sdk.create_lora_training_client(model, rank=4, seed=1).result()
    out = tc.forward(  # forward only: the same run can be compared without a step between
        [datum], "cross_entropy").result()
    mine = ours.create_lora_training_client(model, rank=4, seed=1)
    from temper.client import Datum, TensorData
    theirs = mine.forward([Datum(model_input=ModelInput(chunks=[our_input.chunks[0], ImageChunk(RED, "png", 4)]),
                                 loss_fn_inputs={"target_tokens": TensorData.from_numpy(targets),
                                                 "weights": TensorData.from_numpy(np.ones(n, np.float32))})],
                          "cross_entropy").result()
    np.testing.assert_array_equal(out.loss_fn_outputs[0]["logprobs"].to_numpy(), theirs.loss_fn_outputs[0]["logprobs"].to_numpy())
    assert len(out.loss_fn_outputs[0]["logprobs"].to_numpy()) == n
    fb = tc.forward_backward([datum], "cross_entropy").result()
    assert np.isfinite(fb.metrics["loss:sum"])


def test_an_uploaded_image_is_sampled_by_pointer(vl_stack, sdk, ours, model, tokenizer):
    resp = httpx.post(f"{vl_stack.gateway_url}/api/v1/images?base_model={model}", content=RED, timeout=60,
                      headers={"X-API-Key": vl_stack.api_key, "Content-Type": "image/png"})
    assert resp.status_code == 200, resp.text
    asset = resp.json()
    assert asset["location"].startswith("temper-image://") and asset["expected_tokens"] == 4
    prompt_ids = tokenizer.encode("colour:")
    params = dict(max_tokens=4, seed=5)
    by_pointer = sdk.create_sampling_client(base_model=model).result().sample(tt.ModelInput(chunks=[
        tt.EncodedTextChunk(tokens=prompt_ids), tt.ImageAssetPointerChunk(location=asset["location"], format="png")]), 1,
        tt.SamplingParams(**params)).result()
    by_bytes = ours.create_sampling_client(base_model=model).sample(ModelInput(chunks=[
        EncodedTextChunk(tokens=prompt_ids), ImageChunk(RED, "png")]), sampling_params=SamplingParams(**params)).result()
    assert by_pointer.sequences[0].tokens == by_bytes.sequences[0].tokens
    listed = httpx.get(f"{vl_stack.gateway_url}/api/v1/images", headers={"X-API-Key": vl_stack.api_key}).json()
    assert asset["location"] in [i["location"] for i in listed["images"]]
    again = ours.create_sampling_client(base_model=model).sample(ModelInput(chunks=[
        EncodedTextChunk(tokens=prompt_ids), ImageAssetPointerChunk(asset["location"], "png")]),
        sampling_params=SamplingParams(**params)).result()
    assert again.sequences[0].tokens == by_bytes.sequences[0].tokens


def test_tinker_route_refusals(vl_stack, model):
    headers = {"X-API-Key": vl_stack.api_key}
    session = httpx.post(f"{vl_stack.gateway_url}/api/v1/create_session", headers=headers, timeout=60, json={
        "tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    sampler = httpx.post(f"{vl_stack.gateway_url}/api/v1/create_sampling_session", headers=headers, timeout=60, json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": model}).json()["sampling_session_id"]
    for chunk, words in [({"type": "image", "data": "@@", "format": "png"}, "not valid base64"),
                         ({"type": "image_asset_pointer", "location": "https://example.com/a.png", "format": "png"},
                          "temper-image://"),
                         ({"type": "dmel", "dmel": b64(b"x")}, "audio (dmel)")]:
        resp = httpx.post(f"{vl_stack.gateway_url}/api/v1/asample", headers=headers, timeout=60, json={
            "sampling_session_id": sampler, "num_samples": 1, "prompt": {"chunks": [chunk]},
            "sampling_params": {"max_tokens": 2}})
        assert resp.status_code == 400 and words in resp.json()["error"], resp.text


# ---- the model's VisionInfo in the public API ----------------------------------------------------

def tokenizer_files(stack, base_model: str) -> dict[str, bytes]:
    files: dict[str, bytearray] = {}
    for chunk in raw_stub(stack).GetTokenizer(service_pb2.GetTokenizerRequest(base_model=base_model)):
        data = files.setdefault(chunk.relative_path, bytearray(chunk.total_size))
        data[chunk.offset: chunk.offset + len(chunk.data)] = chunk.data
    return {name: bytes(data) for name, data in files.items()}


def test_capabilities_describe_the_vl_models_vision_and_the_client_counts_with_it(vl_stack, model):
    from transformers import AutoConfig

    folder = model
    config = AutoConfig.from_pretrained(folder)
    with open(f"{folder}/preprocessor_config.json") as f:
        processor_json = f.read()
    [raw] = raw_stub(vl_stack).GetServerCapabilities(service_pb2.GetServerCapabilitiesRequest()).supported_models
    assert raw.HasField("vision") and raw.family == "qwen3_vl"
    assert (raw.vision.image_token_id, raw.vision.vision_start_token_id, raw.vision.vision_end_token_id) == (
        config.image_token_id, config.vision_start_token_id, config.vision_end_token_id)
    assert json.loads(raw.vision.image_processor_json) == json.loads(processor_json)

    client = vl_stack.client()
    try:
        [described] = client.get_server_capabilities().supported_models
        assert described.vision is not None and described.vision.image_token_id == config.image_token_id
        for size in [(64, 64), (128, 64)]:
            uploaded = client.upload_image(png_bytes("green", size), base_model=folder)  # the scheduler's count
            assert described.vision.count_image_tokens(*size) == uploaded.expected_tokens
        assert described.vision.count_image_tokens(64, 64) == 4
    finally:
        client.close()

    files = tokenizer_files(vl_stack, folder)
    assert json.loads(files["preprocessor_config.json"]) == json.loads(processor_json)
    assert "tokenizer_config.json" in files


def test_a_text_only_model_has_no_vision_and_no_image_processor_file(stack, tiny_model_dir):
    [raw] = raw_stub(stack).GetServerCapabilities(service_pb2.GetServerCapabilitiesRequest()).supported_models
    assert raw.model_name == tiny_model_dir and not raw.HasField("vision")
    client = stack.client()
    try:
        [model] = client.get_server_capabilities().supported_models
        assert model.vision is None and model.trainable and model.sampleable
    finally:
        client.close()
    files = tokenizer_files(stack, tiny_model_dir)
    assert "preprocessor_config.json" not in files and "tokenizer_config.json" in files
