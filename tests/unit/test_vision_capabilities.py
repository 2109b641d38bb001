"""A vision-language model's VisionInfo in the public model description, without a model: the scheduler's
GetServerCapabilities carries what the model's workers report (ModelInfo.vision) and nothing for a
text-only model; temper.client reads it into a plain dataclass that counts an image's tokens with the
one image path; the trainer's tokenizer files hold the model's image processor beside the tokenizer."""

from __future__ import annotations

import asyncio
import json

import pytest

from fakes_scheduler import MODEL, FakeTrainer, servicer_over_fakes
from temper.client import convert as client_convert
from temper.client import types as t
from temper.services.models import images
from temper.services.trainer.tokenizer_files import IMAGE_PROCESSOR_FILE, tokenizer_files
from temper.v1 import service_pb2, trainer_pb2, types_pb2


@pytest.fixture(scope="module")
def processor_json() -> str:
    """The tiny Qwen3-VL's preprocessor_config.json (a 64x64 image: 4 image tokens)."""
    from temper.services.models import tiny_vision

    config = tiny_vision.TINY_VL_FAMILIES["qwen3_vl"](64, 2, tiny_vision.qwen_tokenizer())
    return json.dumps(tiny_vision._preprocessor_config(config))


def vision_info(processor_json: str) -> types_pb2.VisionInfo:
    return types_pb2.VisionInfo(image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653,
                                image_processor_json=processor_json)


def capabilities(trainer: FakeTrainer) -> service_pb2.GetServerCapabilitiesResponse:
    async def main():
        async with servicer_over_fakes(trainer) as (_, api):
            return await api.GetServerCapabilities(service_pb2.GetServerCapabilitiesRequest(), None)

    return asyncio.run(main())


def test_capabilities_carry_the_vision_info_the_workers_report_and_none_for_a_text_only_model(processor_json):
    reported = vision_info(processor_json)
    vl = FakeTrainer(info=trainer_pb2.ModelInfo(base_model=MODEL, max_context_length=64, family="qwen3_vl", vision=reported))
    [model] = capabilities(vl).supported_models
    assert model.HasField("vision") and model.vision == reported and model.family == "qwen3_vl"
    [model] = capabilities(FakeTrainer()).supported_models
    assert not model.HasField("vision") and model.trainable


def test_the_client_reads_vision_info_as_a_dataclass_that_counts_as_the_server_does(processor_json):
    response = service_pb2.GetServerCapabilitiesResponse(supported_models=[
        service_pb2.SupportedModel(model_name="vl", max_context_length=64, trainable=True, sampleable=True, family="qwen3_vl",
                                   vision=vision_info(processor_json)),
        service_pb2.SupportedModel(model_name="text", max_context_length=64, trainable=True, family="qwen3")])
    vl, text = client_convert.capabilities_from_proto(response).supported_models
    assert vl.vision == t.VisionInfo(151655, 151652, 151653, processor_json) and text.vision is None
    assert (vl.model_name, vl.family, text.model_name) == ("vl", "qwen3_vl", "text")
    server = images.VisionProcessor.from_info(vision_info(processor_json))
    for width, height in [(64, 64), (128, 64), (100, 37)]:
        assert vl.vision.count_image_tokens(width, height) == server.count(width, height)
    assert vl.vision.count_image_tokens(64, 64) == 4  # the tiny processor: 64x64 -> 4 image tokens


def test_tokenizer_files_hold_the_image_processor_of_a_vision_model_only(processor_json, tmp_path):
    from temper.services.models.tiny_vision import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    with_processor = tokenizer_files(tokenizer, processor_json)
    assert with_processor[IMAGE_PROCESSOR_FILE] == processor_json.encode()
    plain = tokenizer_files(tokenizer)
    assert IMAGE_PROCESSOR_FILE not in plain and set(plain) == set(with_processor) - {IMAGE_PROCESSOR_FILE}
    for name, data in with_processor.items():
        (tmp_path / name).write_bytes(data)
    from transformers import AutoImageProcessor, AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path).encode("hi") == tokenizer.encode("hi")
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    assert processor.to_dict()["patch_size"] == json.loads(processor_json)["patch_size"]
