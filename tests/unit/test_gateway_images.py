"""Images through the gateway, in process: the Tinker SDK's image chunks (JSON and protobuf, encoded by
the SDK itself), OpenAI image_url parts and Anthropic image blocks rendered into a model input with the
model's chat template, and every refusal with its status and message. The scheduler is a stand-in that
records what reaches it; the model is a config-only tiny Qwen3-VL folder (tokenizer with Qwen3's real
special ids, its image processor), so no weights are loaded."""

import base64

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker import types as tt
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_request import ForwardBackwardRequest

from fixtures_stack import RedSampler, png_bytes, tiny_vl_config_folder
from temper.common.codec import decode_tokens
from temper.services.gateway import anthropic_convert as ac
from temper.services.gateway import chat_prompt, convert, image_parts
from temper.services.gateway import openai_convert as oc
from temper.services.gateway import tinker_wire_pb2 as wire
from temper.services.gateway.app import create_app
from temper.services.gateway.errors import GatewayError, http_status
from temper.services.gateway.openai_targets import vision_of
from temper.services.models import images
from temper.v1 import service_pb2, types_pb2

KEY = {"Authorization": "Bearer tml-k"}
RED, BLUE = png_bytes("red"), png_bytes("blue", (128, 64), "JPEG")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def refused(call, status: int, *words: str) -> str:
    with pytest.raises(GatewayError) as info:
        call()
    message = info.value.message
    assert http_status(info.value) == status and all(w in message for w in words), (http_status(info.value), message)
    return message


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    """A tiny Qwen3-VL folder without weights: config.json, tokenizer, preprocessor_config.json."""
    return tiny_vl_config_folder(tmp_path_factory.mktemp("tiny-vl-config"))


@pytest.fixture(scope="module")
def vl_model(vl_folder):
    from transformers import AutoTokenizer

    vision, _ = vision_of(vl_folder)
    return chat_prompt.ChatModel("tiny-vl", AutoTokenizer.from_pretrained(vl_folder), vision)


# ---- the Tinker SDK's chunks ---------------------------------------------------------------------------------

def test_sdk_json_chunks_become_temper_chunks():
    sdk = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1, 2]), tt.ImageChunk(data=RED, format="png", expected_tokens=4),
                                tt.ImageAssetPointerChunk(location="temper-image://" + "ab" * 32, format="jpeg"),
                                tt.ImageChunk(data=BLUE, format="jpeg")])
    out = convert.model_input_from_json(sdk.model_dump(exclude_none=True, mode="json"))
    assert [c.WhichOneof("chunk") for c in out.chunks] == ["encoded_text", "image", "image_asset_pointer", "image"]
    assert decode_tokens(out.chunks[0].encoded_text.tokens).tolist() == [1, 2]
    assert (out.chunks[1].image.data, out.chunks[1].image.format, out.chunks[1].image.expected_tokens) == (RED, "png", 4)
    assert out.chunks[2].image_asset_pointer.location == "temper-image://" + "ab" * 32
    assert not out.chunks[2].image_asset_pointer.HasField("expected_tokens")
    assert out.chunks[3].image.data == BLUE and not out.chunks[3].image.HasField("expected_tokens")


@pytest.mark.parametrize("chunk, words", [
    ({"type": "image", "data": "not base64!", "format": "png"}, ["chunks[0].data", "not valid base64"]),
    ({"type": "image", "data": b64(RED)[:-1], "format": "png"}, ["not valid base64"]),
    ({"type": "image", "data": 5, "format": "png"}, ["base64 string"]),
    ({"type": "image", "data": b64(RED), "format": "gif"}, ["chunks[0].format", "'png', 'jpeg'"]),
    ({"type": "image", "data": b64(RED), "format": "png", "expected_tokens": -1}, ["expected_tokens"]),
    ({"type": "image_asset_pointer", "location": "https://example.com/a.png", "format": "png"}, ["temper-image://", "URLs"]),
    ({"type": "image_asset_pointer", "location": "/etc/passwd", "format": "png"}, ["temper-image://<sha256>"]),
    ({"type": "image_asset_pointer", "location": "temper-image://abc", "format": "png"}, ["temper-image://<sha256>"]),
    ({"type": "dmel", "dmel": b64(b"\0" * 8)}, ["audio (dmel)", "no open model"]),
    ({"type": "video", "data": ""}, ["'video'", "encoded_text, image, image_asset_pointer"]),
])
def test_sdk_json_chunk_refusals(chunk, words):
    refused(lambda: convert.model_input_from_json({"chunks": [chunk]}), 400, *words)


def _sdk_forward_backward(chunk) -> bytes:
    datum = tt.Datum(model_input=tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[5]), chunk]),
                     loss_fn_inputs={"target_tokens": tt.TensorData(data=[1] * 5, dtype="int64", shape=[5])})
    request = ForwardBackwardRequest(model_id="s:train:0", seq_id=1, forward_backward_input=tt.ForwardBackwardInput(
        data=[datum], loss_fn="cross_entropy"))
    return forward_backward_request_to_proto(request).SerializeToString()


def test_sdk_protobuf_image_chunk_becomes_a_temper_chunk():
    body = _sdk_forward_backward(tt.ImageChunk(data=RED, format="png", expected_tokens=4))
    req = convert.forward_backward_from_wire(convert.parse_forward_backward(body))
    image = req.data[0].model_input.chunks[1].image
    assert (image.data, image.format, image.expected_tokens) == (RED, "png", 4)
    body = _sdk_forward_backward(tt.ImageChunk(data=BLUE, format="jpeg"))
    image = convert.forward_backward_from_wire(convert.parse_forward_backward(body)).data[0].model_input.chunks[1].image
    assert image.data == BLUE and not image.HasField("expected_tokens")


def test_protobuf_chunk_refusals():
    def request(chunk: wire.Chunk):
        msg = wire.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
        msg.data.add().model_input.append(chunk)
        return lambda: convert.forward_backward_from_wire(msg)

    dims = wire.Chunk(image=wire.ImageChunk(data=RED, format="png", override_dimensions=wire.ImageDimensions(width=8, height=8)))
    refused(request(dims), 400, "data[0].model_input[0]", "override_dimensions")
    refused(request(wire.Chunk(image=wire.ImageChunk(data=RED, format="bmp"))), 400, "data[0].model_input[0].format")
    refused(request(wire.Chunk(dmel=wire.DmelChunk(dmel=b"x"))), 400, "audio (dmel)")
    refused(request(wire.Chunk()), 400, "empty chunk")


# ---- OpenAI parts and Anthropic blocks -------------------------------------------------------------------------

def test_openai_image_parts_and_their_refusals():
    url = f"data:image/png;base64,{b64(RED)}"
    [message] = oc.chat_messages({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what colour?"}, {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]})
    assert message["content"][0] == {"type": "text", "text": "what colour?"}
    assert message["content"][1] == {"type": "image", "image": image_parts.ImageBytes(RED, "png")}
    jpeg = oc.chat_messages({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": f"data:image/jpeg;base64,{b64(BLUE)}"}]}]})
    assert jpeg[0]["content"][0]["image"] == image_parts.ImageBytes(BLUE, "jpeg")

    def chat(part):
        return lambda: oc.chat_messages({"messages": [{"role": "user", "content": [part]}]})

    refused(chat({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}), 400,
            "messages[0].content[0].image_url.url", "remote image URLs are not fetched; send a data: URL")
    refused(chat({"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}), 400, "not fetched")
    refused(chat({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}), 400, "only data: URLs")
    refused(chat({"type": "image_url", "image_url": {"url": f"data:image/gif;base64,{b64(RED)}"}}), 400,
            "image/gif", "image/png or image/jpeg")
    refused(chat({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}), 400, "must be base64")
    refused(chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}), 400, "not valid base64")
    refused(chat({"type": "image_url"}), 400, "data: URL string")
    refused(chat({"type": "input_audio", "input_audio": {}}), 400, "only text and image_url parts")


def test_anthropic_image_blocks_and_their_refusals():
    source = {"type": "base64", "media_type": "image/jpeg", "data": b64(BLUE)}
    chat, continued = ac.chat_messages({"system": "be brief", "messages": [{"role": "user", "content": [
        {"type": "image", "source": source}, {"type": "text", "text": "colour?"}]}]})
    assert chat[0] == {"role": "system", "content": "be brief"} and not continued
    assert chat[1]["content"] == [{"type": "image", "image": image_parts.ImageBytes(BLUE, "jpeg")},
                                  {"type": "text", "text": "colour?"}]

    def blocks(*content, system=None):
        body = {"messages": [{"role": "user", "content": list(content)}]}
        return lambda: ac.chat_messages({**body, **({"system": system} if system is not None else {})})

    refused(blocks({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}), 400,
            "messages[0].content[0].source", "remote image URLs are not fetched")
    refused(blocks({"type": "image", "source": {**source, "media_type": "image/webp"}}), 400, "image/webp")
    refused(blocks({"type": "image", "source": {**source, "data": "%%"}}), 400, "source.data is not valid base64")
    refused(blocks({"type": "image", "source": {"type": "file", "file_id": "f"}}), 400, "must be base64")
    refused(blocks({"type": "image"}), 400, "source must be an object")
    refused(blocks({"type": "document", "source": source}), 400, "only text and image blocks")
    refused(blocks({"type": "text", "text": "x"}, system=[{"type": "image", "source": source}]), 400,
            "system[0]", "only text blocks")


# ---- rendering with the model's template -----------------------------------------------------------------------

def test_chat_images_replace_the_templates_image_tokens(vl_model):
    vision, tokenizer = vl_model.vision, vl_model.tokenizer
    messages = oc.chat_messages({"messages": [
        {"role": "system", "content": "you see colours"},
        {"role": "user", "content": [{"type": "text", "text": "first"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(RED)}"}},
                                     {"type": "text", "text": "then"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{b64(BLUE)}"}}]}]})
    prompt = chat_prompt.render(vl_model, messages)
    kinds = [c.WhichOneof("chunk") for c in prompt.model_input.chunks]
    assert kinds == ["encoded_text", "image", "encoded_text", "image", "encoded_text"]
    assert [(c.image.data, c.image.format) for c in prompt.model_input.chunks if c.HasField("image")] == [(RED, "png"),
                                                                                                        (BLUE, "jpeg")]
    assert not any(c.image.HasField("expected_tokens") for c in prompt.model_input.chunks if c.HasField("image"))
    # directly: the template's text, its one image token per image expanded into that image's N by the processor
    text = tokenizer.apply_chat_template([{"role": "system", "content": "you see colours"}, {"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "image"}, {"type": "text", "text": "then"}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True)
    counts = iter([vision.count(64, 64), vision.count(128, 64)])
    expected = []
    for t in tokenizer.encode(text, add_special_tokens=False):
        expected.extend([t] * next(counts) if t == vision.tokens.image else [t])
    flat = images.flatten(prompt.model_input, vision)
    assert flat.tokens.tolist() == expected and len(prompt) == len(expected)
    assert [(i.width, i.height, i.tokens) for i in flat.images] == [(64, 64, 4), (128, 64, 8)]
    # each image sits between the vision start and end tokens, which stay text
    image_at = [i.offset for i in flat.images]
    assert [expected[o - 1] for o in image_at] == [vision.tokens.start] * 2
    assert [expected[o + n] for o, n in zip(image_at, (4, 8))] == [vision.tokens.end] * 2
    # a text-only chat is token ids, as before images
    assert chat_prompt.render(vl_model, [{"role": "user", "content": "hi"}]) == tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)


def test_chat_image_refusals(vl_model, vl_folder):
    def user(*parts):
        return oc.chat_messages({"messages": [{"role": "user", "content": list(parts)}]})

    def image(data: bytes, media: str = "image/png"):
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{b64(data)}"}}

    text_only = chat_prompt.ChatModel("smol", vl_model.tokenizer, None)
    refused(lambda: chat_prompt.render(text_only, user(image(RED))), 400, "smol takes no images", "text-only model")
    vision, why = vision_of(vl_folder + "/not-here")
    assert vision is None
    remote = chat_prompt.ChatModel("tiny-vl", vl_model.tokenizer, None, why)
    refused(lambda: chat_prompt.render(remote, user(image(RED))), 400, "not on this machine")
    refused(lambda: chat_prompt.render(vl_model, user(image(RED[:40]))), 400, "image 0", "corrupt PNG")
    refused(lambda: chat_prompt.render(vl_model, user(image(BLUE))), 400, "not a PNG file")  # JPEG bytes called PNG
    small = images.ImageLimits(max_bytes=len(RED) - 1)
    refused(lambda: chat_prompt.render(vl_model, user(image(RED)), limits=small), 413, "exceed the limit")
    refused(lambda: chat_prompt.render(vl_model, user(image(png_bytes("red", (64, 300)))),
                                       limits=images.ImageLimits(max_side=256)), 413, "64x300")
    refused(lambda: chat_prompt.render(vl_model, user(image(RED), image(RED)), limits=images.ImageLimits(max_images=1)),
            413, "2 images", "at most 1")
    refused(lambda: chat_prompt.render(vl_model, user({"type": "text", "text": "<|image_pad|>"}, image(RED))), 400,
            "1 images", "rendered 2 image tokens")


# ---- the routes, with a scheduler stand-in --------------------------------------------------------------------

class Scheduler(RedSampler):
    """Just enough of the scheduler for the OpenAI and Anthropic routes; records each Sample."""

    def __init__(self, folder: str, tokenizer):
        self.folder, self.samples, self.tokenizer = folder, [], tokenizer

    async def call(self, method, request, key):
        if method == "CreateSession":
            return service_pb2.Session(session_id="s")
        if method == "CreateSamplingClient":
            return service_pb2.SamplingClientInfo(sampler_id="s:sample:0", base_model="tiny-vl", tokenizer_id=self.folder)
        if method == "GetServerCapabilities":
            return service_pb2.GetServerCapabilitiesResponse(supported_models=[service_pb2.SupportedModel(
                model_name="tiny-vl", max_context_length=256, sampleable=True)])
        raise GatewayError(grpc.StatusCode.UNIMPLEMENTED, method)


@pytest.fixture
def routes(vl_folder, vl_model):
    scheduler = Scheduler(vl_folder, vl_model.tokenizer)
    with TestClient(create_app(scheduler)) as http:
        yield http, scheduler


def test_chat_and_messages_routes_send_images_to_sample(routes, vl_model):
    http, scheduler = routes
    url = f"data:image/png;base64,{b64(RED)}"
    resp = http.post("/v1/chat/completions", headers=KEY, json={"model": "tiny-vl", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "colour?"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "red"
    sample = scheduler.samples[-1]
    flat = images.flatten(sample.prompt, vl_model.vision)
    assert [c.image.data for c in sample.prompt.chunks if c.HasField("image")] == [RED]
    assert resp.json()["usage"]["prompt_tokens"] == len(flat) and len(flat.images) == 1  # image tokens counted

    source = {"type": "base64", "media_type": "image/png", "data": b64(RED)}
    resp = http.post("/v1/messages", headers=KEY, json={"model": "tiny-vl", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "colour?"}]}]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["content"] == [{"type": "text", "text": "red"}]
    assert resp.json()["usage"]["input_tokens"] == len(images.flatten(scheduler.samples[-1].prompt, vl_model.vision))


def test_route_refusals_are_400_or_413_and_sample_nothing(routes):
    http, scheduler = routes
    chat = {"model": "tiny-vl", "max_tokens": 8}

    def openai(part, status, words):
        resp = http.post("/v1/chat/completions", headers=KEY, json={**chat, "messages": [{"role": "user", "content": [part]}]})
        assert resp.status_code == status and words in resp.json()["error"]["message"], resp.text

    openai({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, 400,
           "remote image URLs are not fetched; send a data: URL")
    openai({"type": "image_url", "image_url": {"url": f"data:image/gif;base64,{b64(RED)}"}}, 400, "image/gif")
    openai({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(RED[:30])}"}}, 400, "corrupt PNG")
    resp = http.post("/v1/messages", headers=KEY, json={**chat, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert resp.status_code == 400 and "not fetched" in resp.json()["error"]["message"], resp.text
    http.app.state.image_limits = images.ImageLimits(max_bytes=100)
    openai({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(RED)}"}}, 413, "exceed the limit")
    assert scheduler.samples == []


class Recorder:
    """The Tinker routes' scheduler: records each verb, answers it empty."""

    def __init__(self):
        self.calls = []

    async def verb(self, method, request, key):
        self.calls.append((method, request))
        return types_pb2.SampleResponse() if method == "Sample" else types_pb2.ForwardBackwardOutput()

    async def close(self):
        pass


def test_tinker_routes_pass_images_on_and_refuse_bad_base64():
    scheduler = Recorder()
    with TestClient(create_app(scheduler, long_poll_seconds=5)) as http:
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1]}, {"type": "image", "data": b64(RED), "format": "png"}]}
        body = {"sampling_session_id": "s:sample:0", "seq_id": 1, "num_samples": 1, "prompt": prompt,
                "sampling_params": {"max_tokens": 2}}
        future = http.post("/api/v1/asample", headers=KEY, json=body).json()
        assert http.post("/api/v1/retrieve_future", headers=KEY, json=future).status_code == 200
        [(method, sample)] = [c for c in scheduler.calls if c[0] == "Sample"]
        assert sample.prompt.chunks[1].image.data == RED
        bad = {**body, "seq_id": 2, "prompt": {"chunks": [{"type": "image", "data": "??", "format": "png"}]}}
        resp = http.post("/api/v1/asample", headers=KEY, json=bad)
        assert resp.status_code == 400 and "prompt.chunks[0].data is not valid base64" in resp.json()["error"]
        fb = _sdk_forward_backward(tt.ImageChunk(data=RED, format="png", expected_tokens=4))
        future = http.post("/api/v1/forward_backward", headers={**KEY, "Content-Type": "application/x-protobuf"},
                           content=fb).json()
        http.post("/api/v1/retrieve_future", headers=KEY, json=future)
        [(_, sent)] = [c for c in scheduler.calls if c[0] == "ForwardBackward"]
        assert sent.data[0].model_input.chunks[1].image.expected_tokens == 4 and sent.data[0].model_input.chunks[1].image.data == RED

        # checked early with the one image path: too large is a final 413 (the scheduler's RESOURCE_EXHAUSTED
        # would read as backpressure, which the gateway resends), corrupt a 400; nothing reaches Sample
        wide = {"type": "image", "data": b64(png_bytes("red", (9000, 1))), "format": "png"}
        resp = http.post("/api/v1/asample", headers=KEY, json={**body, "seq_id": 3, "prompt": {"chunks": [wide]}})
        assert resp.status_code == 413 and "9000x1 has a side over the limit" in resp.json()["error"], resp.text
        corrupt = {"type": "image", "data": b64(RED[:40]), "format": "png"}
        resp = http.post("/api/v1/asample", headers=KEY, json={**body, "seq_id": 4, "prompt": {"chunks": [corrupt]}})
        assert resp.status_code == 400 and "prompt 0 chunk 0: corrupt PNG" in resp.json()["error"], resp.text
        assert len([c for c in scheduler.calls if c[0] == "Sample"]) == 1
        fb = _sdk_forward_backward(tt.ImageChunk(data=png_bytes("red", (9000, 1)), format="png"))
        future = http.post("/api/v1/forward_backward", headers={**KEY, "Content-Type": "application/x-protobuf"},
                           content=fb.replace(b"s:train:0", b"s:train:1")).json()
        failed = http.post("/api/v1/retrieve_future", headers=KEY, json=future).json()
        assert "datum 0 chunk 1: 9000x1 has a side over the limit" in failed["error"]
        # the seq is spent with an empty forward_backward: no datum with the image reached the scheduler
        assert [len(r.data) for m, r in scheduler.calls if m == "ForwardBackward"] == [1, 0]

