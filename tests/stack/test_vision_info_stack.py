"""A model's VisionInfo in the public API, on real processes: GetServerCapabilities describes the tiny
Qwen3-VL with the image token ids and image processor its workers read from its folder (and the text-only
tiny model with none); temper.client counts an image's tokens from it exactly as the scheduler counts an
upload's; GetTokenizer's files hold the VL model's preprocessor_config.json (get_tokenizer() folders on
another machine load the image processor too) and no such file for a text-only model."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from fixtures_stack import png_bytes, raw_stub
from temper.localstack import LocalStack
from temper.v1 import service_pb2


@pytest.fixture(scope="module")
def vl_stack(vl_model_dirs, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_vision_caps")
    with LocalStack(vl_model_dirs["qwen3_vl"], tmp_path_factory.mktemp("vision-caps"), database_url=url,
                    num_threads=1) as local:
        local.address = local.start()
        local.model = vl_model_dirs["qwen3_vl"]
        yield local


def tokenizer_files(stack, base_model: str) -> dict[str, bytes]:
    files: dict[str, bytearray] = {}
    for chunk in raw_stub(stack).GetTokenizer(service_pb2.GetTokenizerRequest(base_model=base_model)):
        data = files.setdefault(chunk.relative_path, bytearray(chunk.total_size))
        data[chunk.offset: chunk.offset + len(chunk.data)] = chunk.data
    return {name: bytes(data) for name, data in files.items()}


def test_capabilities_describe_the_vl_models_vision_and_the_client_counts_with_it(vl_stack):
    folder = vl_stack.model
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
        [model] = client.get_server_capabilities().supported_models
        assert model.vision is not None and model.vision.image_token_id == config.image_token_id
        for size in [(64, 64), (128, 64)]:
            uploaded = client.upload_image(png_bytes("green", size), base_model=folder)  # the scheduler's count
            assert model.vision.count_image_tokens(*size) == uploaded.expected_tokens
        assert model.vision.count_image_tokens(64, 64) == 4
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
