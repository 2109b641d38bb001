"""A gateway on another machine than the model's folder (the docker-compose layout) counts and checks chat
images with the model's VisionInfo from the scheduler's capabilities (SupportedModel.vision) and the
tokenizer files GetTokenizer streams (the trainer's, preprocessor_config.json included): the same image
tokens as a gateway reading the folder. A model the capabilities describe without vision is text-only;
one they do not describe at all is refused, saying the gateway cannot count its images."""

from __future__ import annotations

import base64

import grpc
import pytest
from fastapi.testclient import TestClient

from fixtures_stack import RedSampler, png_bytes, tiny_vl_config_folder
from temper.services.gateway.app import create_app
from temper.services.gateway.errors import GatewayError
from temper.services.gateway.openai_targets import vision_of
from temper.services.models import images
from temper.services.trainer import convert as trainer_convert
from temper.services.trainer.tokenizer_files import IMAGE_PROCESSOR_FILE, file_pieces, tokenizer_files
from temper.v1 import service_pb2

KEY = {"Authorization": "Bearer tml-k"}
RED, WIDE = png_bytes("red"), png_bytes("blue", (128, 64))
NOT_HERE = "/models/on-the-trainers-machine/tiny-vl"  # the tokenizer id the scheduler names: no such folder here


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    """A tiny Qwen3-VL folder without weights (config.json, tokenizer, preprocessor_config.json): what the
    workers read; the gateway under test never sees it."""
    return tiny_vl_config_folder(tmp_path_factory.mktemp("tiny-vl-remote"))


@pytest.fixture(scope="module")
def local_vision(vl_folder) -> images.VisionProcessor:
    vision, _ = vision_of(vl_folder)
    assert vision is not None
    return vision


class RemoteScheduler(RedSampler):
    """The scheduler as a remote gateway sees it: a tokenizer id naming a folder on the workers' machine,
    the tokenizer files as the trainer streams them, and the model described by its capabilities."""

    def __init__(self, vl_folder: str, described: service_pb2.SupportedModel | None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(vl_folder)
        with open(f"{vl_folder}/preprocessor_config.json") as f:
            self.files = tokenizer_files(self.tokenizer, f.read())
        self.described, self.samples, self.calls = described, [], []

    async def call(self, method, request, key):
        self.calls.append(method)
        if method == "CreateSession":
            return service_pb2.Session(session_id="s")
        if method == "CreateSamplingClient":
            return service_pb2.SamplingClientInfo(sampler_id="s:sample:0", base_model="tiny-vl", tokenizer_id=NOT_HERE)
        if method == "GetServerCapabilities":
            return service_pb2.GetServerCapabilitiesResponse(supported_models=[self.described] if self.described else [])
        raise GatewayError(grpc.StatusCode.UNIMPLEMENTED, method)

    async def stream(self, method, request, key):
        assert method == "GetTokenizer" and request.base_model == "tiny-vl"
        self.calls.append(method)
        return list(trainer_convert.file_chunks_to_pb(file_pieces(self.files)))


def described(vision: images.VisionProcessor | None) -> service_pb2.SupportedModel:
    model = service_pb2.SupportedModel(model_name="tiny-vl", max_context_length=256, sampleable=True, family="qwen3_vl")
    if vision is not None:
        model.vision.CopyFrom(vision.info())
    return model


def chat(http, *parts, status=200):
    resp = http.post("/v1/chat/completions", headers=KEY, json={"model": "tiny-vl", "max_tokens": 8, "messages": [
        {"role": "user", "content": list(parts)}]})
    assert resp.status_code == status, resp.text
    return resp.json()


def image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(data).decode()}"}}


@pytest.fixture
def tokenizer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPER_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    return tmp_path / "tokenizers"


def test_a_gateway_without_the_folder_counts_chat_images_from_the_capabilities(vl_folder, local_vision, tokenizer_cache):
    scheduler = RemoteScheduler(vl_folder, described(local_vision))
    with TestClient(create_app(scheduler)) as http:
        answer = chat(http, {"type": "text", "text": "colours?"}, image(RED), {"type": "text", "text": "and"}, image(WIDE))
        assert answer["choices"][0]["message"]["content"] == "red"
        [sample] = scheduler.samples
        flat = images.flatten(sample.prompt, local_vision)  # as a gateway with the folder (and the workers) count it
        assert [c.image.data for c in sample.prompt.chunks if c.HasField("image")] == [RED, WIDE]
        assert [i.tokens for i in flat.images] == [local_vision.count(64, 64), local_vision.count(128, 64)] == [4, 8]
        assert answer["usage"]["prompt_tokens"] == len(flat)
        # and checked as there: an image over the gateway's limits is refused before anything is sampled
        http.app.state.image_limits = images.ImageLimits(max_side=100)
        assert "128x64" in chat(http, image(WIDE), status=413)["error"]["message"]
    assert len(scheduler.samples) == 1 and "GetTokenizer" in scheduler.calls
    [fetched] = [p for p in tokenizer_cache.iterdir() if p.is_dir()]
    assert (fetched / IMAGE_PROCESSOR_FILE).read_text() == local_vision.processor_json  # get_tokenizer()'s folder


def test_a_model_described_without_vision_is_text_only_and_one_not_described_cannot_be_counted(vl_folder, tokenizer_cache):
    for model, words in [(described(None), "takes no images here: it is a text-only model"),
                         (None, "its folder is not on this machine, so the gateway cannot count its image tokens")]:
        scheduler = RemoteScheduler(vl_folder, model)
        with TestClient(create_app(scheduler)) as http:
            assert words in chat(http, image(RED), status=400)["error"]["message"]
            assert chat(http, {"type": "text", "text": "hi"})["choices"][0]["message"]["content"] == "red"  # text is served
        assert len(scheduler.samples) == 1


def test_vision_of_prefers_the_local_folder_and_falls_back_to_the_description(vl_folder, local_vision):
    remote, _ = vision_of(NOT_HERE, described(local_vision))
    assert remote.tokens == local_vision.tokens and remote.processor_json == local_vision.processor_json
    assert remote.count(100, 37) == local_vision.count(100, 37)
    here, why = vision_of(vl_folder, described(None))  # the folder wins where it exists
    assert here.tokens == local_vision.tokens and why == "it is a text-only model"
    assert vision_of(NOT_HERE, described(None)) == (None, "it is a text-only model")
