"""UploadImage, ListImages, DeleteImage through raw stubs and temper.client on the real stack (Postgres):
content-addressed per tenant (the same bytes twice are one image), another tenant's image never seen,
counted in storage with the checkpoints and refused past max_storage_bytes with nothing stored, a bad
upload refused with nothing stored; and images sent to a text-only base model refused at the
scheduler with nothing changed (issue 30, "Bad input")."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import png_bytes, raw_stub, request_rows, sft_datum
from temper.client import ImageChunk, ModelInput, ResourceExhausted, convert, types
from temper.v1 import service_pb2, types_pb2

REPO = Path(__file__).resolve().parents[2]


def upload_messages(data: bytes, fmt: str = "png", base_model: str = "", piece: int = 100):
    yield service_pb2.UploadImageChunk(header=service_pb2.UploadImageHeader(format=fmt, base_model=base_model))
    for i in range(0, len(data), piece):  # small pieces: the stream is put back together in order
        yield service_pb2.UploadImageChunk(data=data[i: i + piece])


def refused(call, *args, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, timeout=60)
    assert err.value.code() == code, err.value.details()
    assert len(err.value.details()) < 400
    return err.value.details()


def image_rows(url: str, tenant: str) -> list[tuple]:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = conn.execute(text("select i.sha256, i.format, i.width, i.height, i.size_bytes, length(i.data) from images i "
                                  "join tenants t on t.id = i.tenant_id where t.name = :t order by i.id"), {"t": tenant}).all()
    engine.dispose()
    return [tuple(row) for row in found]


def audit_actions(url: str, tenant: str) -> list[str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = conn.execute(text("select action from audit_log where tenant = :t and action like 'image.%' order by id"),
                             {"t": tenant}).scalars().all()
    engine.dispose()
    return list(found)


def test_an_upload_is_content_addressed_per_tenant_and_idempotent(stack, postgres_url):
    red = png_bytes("red", (40, 24))
    stub = raw_stub(stack, "uploader-a")
    first = stub.UploadImage(upload_messages(red), timeout=60)
    digest = hashlib.sha256(red).hexdigest()
    assert (first.location, first.format, first.width, first.height, first.size_bytes, first.created) == (
        f"temper-image://{digest}", "png", 40, 24, len(red), True)
    again = stub.UploadImage(upload_messages(red, piece=7), timeout=60)
    assert again.location == first.location and not again.created and again.created_unix_ms == first.created_unix_ms
    assert image_rows(postgres_url, "uploader-a") == [(digest, "png", 40, 24, len(red), len(red))]
    assert audit_actions(postgres_url, "uploader-a") == ["image.upload"]  # the same bytes again are not a change

    # another tenant uploading the same bytes gets its own image; neither sees the other's
    other = raw_stub(stack, "uploader-b")
    theirs = other.UploadImage(upload_messages(red), timeout=60)
    assert theirs.location == first.location and theirs.created
    listed = stub.ListImages(service_pb2.ListImagesRequest(), timeout=60)
    assert [i.location for i in listed.images] == [first.location] and listed.total == 1
    usage_a = stub.GetUsage(service_pb2.GetUsageRequest(), timeout=60)
    assert usage_a.image_bytes == len(red) and usage_a.storage_bytes >= len(red)

    # deleting: the caller's own only; another tenant's copy stays
    assert other.DeleteImage(service_pb2.DeleteImageRequest(location=first.location), timeout=60).freed_bytes == len(red)
    assert "not found" in refused(other.DeleteImage, service_pb2.DeleteImageRequest(location=first.location),
                                  code=grpc.StatusCode.NOT_FOUND)
    assert image_rows(postgres_url, "uploader-a") == [(digest, "png", 40, 24, len(red), len(red))]
    assert image_rows(postgres_url, "uploader-b") == []
    for location in ("/etc/passwd", "file:///etc/passwd", "https://example.com/x.png", "temper-image://xyz"):
        assert "paths and URLs are not fetched" in refused(stub.DeleteImage, service_pb2.DeleteImageRequest(location=location))


def test_the_client_uploads_lists_and_deletes(stack):
    blue = png_bytes("blue", (32, 32), fmt="JPEG")
    with stack.client("uploader-c") as client:
        asset = client.upload_image(blue)
        assert (asset.format, asset.width, asset.height, asset.created, asset.expected_tokens) == ("jpeg", 32, 32, True, None)
        assert asset.pointer() == types.ImageAssetPointerChunk(location=asset.location, format="jpeg")
        assert [i.location for i in client.list_images()] == [asset.location]
        assert client.get_usage()["image_bytes"] == len(blue)
        assert client.delete_image(asset.location) == len(blue)
        assert client.list_images() == [] and client.get_usage()["image_bytes"] == 0


@pytest.mark.parametrize("messages, code, words", [
    (lambda: upload_messages(b"\x89PNG\r\n\x1a\n" + b"\x07" * 300), grpc.StatusCode.INVALID_ARGUMENT, "corrupt PNG"),
    (lambda: upload_messages(png_bytes(fmt="GIF"), "gif"), grpc.StatusCode.INVALID_ARGUMENT, "format 'gif'"),
    (lambda: upload_messages(png_bytes(fmt="JPEG"), "png"), grpc.StatusCode.INVALID_ARGUMENT, "not a PNG file"),
    (lambda: upload_messages(b""), grpc.StatusCode.INVALID_ARGUMENT, "no image bytes"),
    (lambda: iter([service_pb2.UploadImageChunk(data=png_bytes())]), grpc.StatusCode.INVALID_ARGUMENT, "must be the header"),
    (lambda: iter([]), grpc.StatusCode.INVALID_ARGUMENT, "starts with an UploadImageHeader"),
    (lambda: upload_messages(png_bytes(), base_model="no/such-model"), grpc.StatusCode.INVALID_ARGUMENT, "not served here"),
    (lambda: upload_messages(b"\x89PNG\r\n\x1a\n" + bytes(10 << 20), piece=1 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED,
     f"over the limit of {10 << 20} bytes"),  # the scheduler's default image_max_bytes
])
def test_a_bad_upload_is_refused_and_stores_nothing(stack, postgres_url, messages, code, words):
    stub = raw_stub(stack, "uploader-d")
    assert words in refused(stub.UploadImage, messages(), code=code)
    assert image_rows(postgres_url, "uploader-d") == [] and audit_actions(postgres_url, "uploader-d") == []


def test_an_upload_for_a_text_only_model_is_refused(stack, tiny_model_dir, postgres_url):
    stub = raw_stub(stack, "uploader-d")
    assert "takes text only" in refused(stub.UploadImage, upload_messages(png_bytes(), base_model=tiny_model_dir))
    assert image_rows(postgres_url, "uploader-d") == []


def test_uploads_count_against_max_storage_bytes_and_one_past_it_stores_nothing(stack, postgres_url):
    small, large = png_bytes("red", (8, 8)), png_bytes("green", (200, 200), fmt="JPEG")
    assert len(small) < len(large)
    env = {**os.environ, "TEMPER_SCHEDULER_DATABASE_URL": stack.database_url}
    limit = len(small) + len(large) - 1  # the first fits, both do not
    subprocess.run([sys.executable, "-m", "temper.scheduler.admin", "set-quota", "--tenant", "uploader-e",
                    "--max-storage-bytes", str(limit)], cwd=REPO, env=env, check=True, capture_output=True, timeout=120)
    with stack.client("uploader-e") as client:  # the tenant's first calls: its limits are read fresh
        client.upload_image(small)
        with pytest.raises(ResourceExhausted, match=f"max_storage_bytes = {limit} reached \\(in use: {len(small)}\\)"):
            client.upload_image(large)
        assert client.upload_image(small).created is False  # the same bytes again: nothing more to count
        usage = client.get_usage()
        assert usage["image_bytes"] == usage["storage_bytes"] == len(small)
        assert usage["limits"]["max_storage_bytes"]["used"] == len(small)
    assert [row[4] for row in image_rows(postgres_url, "uploader-e")] == [len(small)]


def test_images_sent_to_a_text_only_model_are_refused_and_change_nothing(stack, service_client, tiny_model_dir, postgres_url):
    stub = raw_stub(stack)
    run = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
    rows, usage = request_rows(postgres_url, run.model_id), stub.GetUsage(service_pb2.GetUsageRequest(), timeout=60)
    datum = convert.datum_to_proto(sft_datum([5, 9, 17, 33]))
    datum.model_input.chunks.append(convert.chunk_to_proto(ImageChunk(data=png_bytes(), format="png", expected_tokens=4)))
    request = service_pb2.ForwardBackwardRequest(training_run_id=run.model_id, seq_id=1, data=[datum], loss_fn="cross_entropy")
    assert "takes text only" in refused(stub.ForwardBackward, request)
    sampler = service_client.create_sampling_client(base_model=tiny_model_dir)
    prompt = convert.model_input_to_proto(ModelInput.from_ints([5, 9]).append(ImageChunk(data=png_bytes(), format="png")))
    assert "takes text only" in refused(stub.Sample, service_pb2.SampleRequest(
        sampler_id=sampler.sampler_id, prompt=prompt, num_samples=1, sampling_params=types_pb2.SamplingParams(max_tokens=2)))
    assert "takes text only" in refused(stub.ComputeLogprobs, service_pb2.ComputeLogprobsRequest(sampler_id=sampler.sampler_id,
                                                                                                 prompt=prompt))
    after = stub.GetUsage(service_pb2.GetUsageRequest(), timeout=60)
    assert request_rows(postgres_url, run.model_id) == rows
    assert (after.tokens_trained, after.tokens_sampled, after.steps) == (usage.tokens_trained, usage.tokens_sampled, usage.steps)
    assert stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=run.model_id), timeout=60).next_seq_id == 2  # the refusal spent seq 1
