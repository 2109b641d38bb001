"""Images through the real stack on the tiny Qwen3-VL-MoE (issue 30), raw gRPC stubs, Postgres.

Every bad-input case of the issue is refused by the scheduler before anything is admitted, pushed or
counted: corrupt bytes, a format other than png/jpeg, zero or oversized dimensions, too many pixels or
bytes (the scheduler's own image limits: RESOURCE_EXHAUSTED), too many images, an expected_tokens
mismatch (naming both numbers), audio, a pointer in forward_backward, and a pointer outside the
caller's own uploads (another tenant's, one never uploaded, a path, a URL); the request log, usage,
sampling records and images are the same afterwards. Images that are fine train and sample with the
flattened length: N image tokens per image, as the model's processor counts them."""

from __future__ import annotations

import hashlib
import re
import struct
import zlib

import grpc
import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import png_bytes, raw_stub, request_rows
from temper.client import Datum, ImageAssetPointerChunk, ImageChunk, ModelInput, convert, types
from temper.v1 import service_pb2, types_pb2

START, END = 151652, 151653       # Qwen3's vision start / end ids (the tiny models keep the real ones)
LIMITS = {"TEMPER_SCHEDULER_IMAGE_MAX_SIDE": "512", "TEMPER_SCHEDULER_IMAGE_MAX_PIXELS": str(300 * 300),
          "TEMPER_SCHEDULER_IMAGE_MAX_BYTES": "100000", "TEMPER_SCHEDULER_IMAGE_MAX_IMAGES": "3"}
GREEDY = types_pb2.SamplingParams(max_tokens=4, temperature=0.0, seed=1, stop_disabled=True)


@pytest.fixture(scope="module")
def vl_stack(vl_model_dirs, new_postgres_database, tmp_path_factory):
    """Scheduler, trainer and sampler on the tiny Qwen3-VL-MoE, its own database, small image limits
    at the scheduler (the workers keep the defaults: what is refused here is the scheduler's doing)."""
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_vision")
    with LocalStack(vl_model_dirs["qwen3_vl_moe"], tmp_path_factory.mktemp("vision"), database_url=url, extra_env=LIMITS,
                    num_threads=1) as local:
        local.address = local.start()
        local.model = vl_model_dirs["qwen3_vl_moe"]
        yield local


@pytest.fixture(scope="module")
def world(vl_stack):
    """The local tenant's session, a run, a sampling client of the base model and one of the run's checkpoint."""
    client = vl_stack.client()
    run = client.create_lora_training_client(vl_stack.model, rank=4, seed=2)
    sampler = client.create_sampling_client(base_model=vl_stack.model)
    path = run.save_weights_for_sampler("start").result().path
    on_checkpoint = client.create_sampling_client(model_path=path)
    yield {"client": client, "run": run.model_id, "sampler": sampler.sampler_id, "stub": raw_stub(vl_stack),
           "checkpoint_sampler": on_checkpoint.sampler_id}
    client.close()


def zero_width_png() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 0, 64, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def noise_png(side: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def tokens(*ids: int) -> types_pb2.ModelInputChunk:
    return convert.chunk_to_proto(types.EncodedTextChunk(tokens=list(ids)))


def image_prompt(*images: types_pb2.ModelInputChunk) -> types_pb2.ModelInput:
    """1 2 <start> image <end> [<start> image <end> ...] 3: each image between the model's vision tokens."""
    chunks = [tokens(1, 2, START)]
    for i, image in enumerate(images):
        chunks += [image, tokens(END, START) if i < len(images) - 1 else tokens(END, 3)]
    return types_pb2.ModelInput(chunks=chunks)


def img(data: bytes, fmt: str = "png", expected: int | None = None) -> types_pb2.ModelInputChunk:
    return convert.chunk_to_proto(ImageChunk(data=data, format=fmt, expected_tokens=expected))


def ptr(location: str, fmt: str = "png", expected: int | None = None) -> types_pb2.ModelInputChunk:
    return convert.chunk_to_proto(ImageAssetPointerChunk(location=location, format=fmt, expected_tokens=expected))


def location_of(data: bytes) -> str:
    return f"temper-image://{hashlib.sha256(data).hexdigest()}"


def upload(stub, data: bytes, base_model: str = "") -> service_pb2.ImageAsset:
    messages = [service_pb2.UploadImageChunk(header=service_pb2.UploadImageHeader(format="png", base_model=base_model)),
                service_pb2.UploadImageChunk(data=data)]
    return stub.UploadImage(iter(messages), timeout=60)


def fb_request(run_id: str, seq: int, prompt: types_pb2.ModelInput, n: int) -> service_pb2.ForwardBackwardRequest:
    datum = types_pb2.Datum(model_input=prompt)
    datum.loss_fn_inputs["target_tokens"].CopyFrom(convert.tensor_to_proto(types.TensorData.from_numpy(np.full(n, 7, np.int64))))
    datum.loss_fn_inputs["weights"].CopyFrom(convert.tensor_to_proto(types.TensorData.from_numpy(np.ones(n, np.float32))))
    return service_pb2.ForwardBackwardRequest(training_run_id=run_id, seq_id=seq, data=[datum], loss_fn="cross_entropy")


def state(url: str, stub, run_id: str) -> tuple:
    """What a refused request must leave as it was: the run's request rows, the tenant's usage, its
    sampling records, images and audit entries, every checkpoint's last use."""
    usage = stub.GetUsage(service_pb2.GetUsageRequest(), timeout=60)
    engine = create_engine(url)
    with engine.connect() as conn:
        counts = tuple(conn.execute(text(f"select count(*) from {table}")).scalar() for table in
                       ("sampling_records", "images", "audit_log", "run_metrics"))
        touched = conn.execute(text("select path, last_used_at from checkpoints order by path")).all()
    engine.dispose()
    return (request_rows(url, run_id), usage.tokens_trained, usage.tokens_sampled, usage.steps, usage.storage_bytes, counts,
            [tuple(row) for row in touched])


def refused(call, request, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=60)
    assert err.value.code() == code, (err.value.code(), err.value.details())
    details = err.value.details()
    assert len(details) < 400 and "Traceback" not in details
    return details


BAD_IMAGES = [  # (label, the prompt, status, the words the message must have)
    ("corrupt bytes", lambda: image_prompt(img(b"\x89PNG\r\n\x1a\n" + bytes(range(200)))), "INVALID_ARGUMENT", "corrupt PNG"),
    ("a cut file", lambda: image_prompt(img(png_bytes()[:70])), "INVALID_ARGUMENT", "corrupt PNG"),
    ("gif", lambda: image_prompt(img(png_bytes(fmt="GIF"), "gif")), "INVALID_ARGUMENT", "format 'gif' is not one of"),
    ("jpeg bytes called png", lambda: image_prompt(img(png_bytes(fmt="JPEG"), "png")), "INVALID_ARGUMENT", "not a PNG file"),
    ("zero width", lambda: image_prompt(img(zero_width_png())), "INVALID_ARGUMENT", r"dimensions 0x64|corrupt PNG"),
    ("a side over the limit", lambda: image_prompt(img(png_bytes(size=(600, 8)))), "RESOURCE_EXHAUSTED",
     "side over the limit of 512"),
    ("too many pixels", lambda: image_prompt(img(png_bytes(size=(310, 310)))), "RESOURCE_EXHAUSTED",
     "exceed the limit of 90000 pixels"),
    ("too many bytes", lambda: image_prompt(img(noise_png(200))), "RESOURCE_EXHAUSTED", "exceed the limit of 100000 bytes"),
    ("too many images", lambda: image_prompt(*[img(png_bytes())] * 4), "RESOURCE_EXHAUSTED", "more than 3 images"),
    ("expected_tokens off", lambda: image_prompt(img(png_bytes(), expected=5)), "INVALID_ARGUMENT",
     r"expected_tokens is 5 but the model's image processor makes 4 image tokens"),
    ("audio", lambda: image_prompt(types_pb2.ModelInputChunk(dmel=types_pb2.DmelChunk(dmel=b"\x00" * 16))), "INVALID_ARGUMENT",
     r"audio \(dmel\)"),
    ("touching images", lambda: types_pb2.ModelInput(chunks=[tokens(1, START), img(png_bytes()), img(png_bytes("blue")),
                                                             tokens(END)]), "INVALID_ARGUMENT", "an image right after another"),
]


@pytest.mark.parametrize("label, bad_prompt, code, words", BAD_IMAGES, ids=[case[0] for case in BAD_IMAGES])
def test_a_bad_image_is_refused_by_every_verb_before_anything_changes(vl_stack, world, label, bad_prompt, code, words):
    stub, url = world["stub"], vl_stack.database_url
    before = state(url, stub, world["run"])
    prompt = bad_prompt()
    seq = stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=world["run"]), timeout=60).next_seq_id
    status = getattr(grpc.StatusCode, code)
    for call, request in (
            (stub.ForwardBackward, fb_request(world["run"], seq, prompt, 9)),
            (stub.Sample, service_pb2.SampleRequest(sampler_id=world["sampler"], prompt=prompt, num_samples=1, sampling_params=GREEDY)),
            (stub.ComputeLogprobs, service_pb2.ComputeLogprobsRequest(sampler_id=world["sampler"], prompt=prompt)),
            # on a checkpoint: refused before its adapter is pushed or its last use written
            (stub.Sample, service_pb2.SampleRequest(sampler_id=world["checkpoint_sampler"], prompt=prompt, num_samples=1,
                                                    sampling_params=GREEDY))):
        details = refused(call, request, status)
        assert re.search(words, details), details
    with pytest.raises(grpc.RpcError) as err:  # a stream is refused before its first message
        list(stub.SampleStream(service_pb2.SampleRequest(sampler_id=world["sampler"], prompt=prompt, num_samples=1,
                                                         sampling_params=GREEDY), timeout=60))
    assert err.value.code() == status and re.search(words, err.value.details())
    after = state(url, stub, world["run"])
    assert after == before, label


def test_a_pointer_in_forward_backward_is_refused(vl_stack, world):
    stub = world["stub"]
    asset = upload(stub, png_bytes("navy"))
    before = state(vl_stack.database_url, stub, world["run"])
    seq = stub.GetInfo(service_pb2.GetInfoRequest(training_run_id=world["run"]), timeout=60).next_seq_id
    details = refused(stub.ForwardBackward, fb_request(world["run"], seq, image_prompt(ptr(asset.location, expected=4)), 9))
    assert "for sampling only" in details
    assert state(vl_stack.database_url, stub, world["run"]) == before


@pytest.mark.parametrize("location", ["/etc/passwd", "file:///etc/hosts", "https://example.com/cat.png",
                                      "http://127.0.0.1:1/x.png", "temper-image://" + "0" * 63, "s3://bucket/key.png"])
def test_a_pointer_that_is_a_path_or_url_is_refused_unread(vl_stack, world, location):
    stub = world["stub"]
    before = state(vl_stack.database_url, stub, world["run"])
    details = refused(stub.Sample, service_pb2.SampleRequest(sampler_id=world["sampler"], prompt=image_prompt(ptr(location)),
                                                             num_samples=1, sampling_params=GREEDY))
    assert "paths and URLs are not fetched" in details
    assert state(vl_stack.database_url, stub, world["run"]) == before


def test_another_tenants_image_is_refused_as_if_it_did_not_exist(vl_stack, world):
    alice, bob = raw_stub(vl_stack, "alice"), world["stub"]
    theirs = upload(alice, png_bytes("teal"))
    never = location_of(png_bytes("olive"))
    before = state(vl_stack.database_url, bob, world["run"])
    answers = []
    for location in (theirs.location, never):
        prompt = image_prompt(ptr(location))
        answers.append(refused(bob.Sample, service_pb2.SampleRequest(sampler_id=world["sampler"], prompt=prompt, num_samples=1,
                                                                     sampling_params=GREEDY)))
        assert refused(bob.ComputeLogprobs, service_pb2.ComputeLogprobsRequest(sampler_id=world["sampler"], prompt=prompt)) == answers[-1]
    # the same words for an image another tenant has and one nobody has: nothing is revealed
    assert [a.replace(theirs.location, "L").replace(never, "L") for a in answers] == ["prompt: image 'L' is not one of your "
                                                                                       "uploaded images (UploadImage)"] * 2
    assert state(vl_stack.database_url, bob, world["run"]) == before


# ---- images that are fine: these need the image-capable trainer and sampler -----------------------

def test_an_upload_for_the_model_says_its_image_tokens(vl_stack, world):
    asset = upload(world["stub"], png_bytes("maroon", (128, 64)), base_model=vl_stack.model)
    assert asset.expected_tokens == 8  # 128x64 in 16-pixel patches, merged 2x2


def test_a_pointer_samples_as_the_same_image_sent_inline_for_its_owner(vl_stack, world):
    stub, data = world["stub"], png_bytes("purple")
    asset = upload(stub, data, base_model=vl_stack.model)
    inline = stub.Sample(service_pb2.SampleRequest(sampler_id=world["sampler"], prompt=image_prompt(img(data, expected=4)),
                                                   num_samples=1, sampling_params=GREEDY), timeout=120)
    pointed = stub.Sample(service_pb2.SampleRequest(sampler_id=world["sampler"], prompt=image_prompt(ptr(asset.location)),
                                                    num_samples=1, sampling_params=GREEDY), timeout=120)
    assert len(inline.sequences[0].tokens) // 4 == GREEDY.max_tokens and pointed.sequences[0].tokens == inline.sequences[0].tokens
    assert pointed.sequences[0].logprobs == inline.sequences[0].logprobs
    other = raw_stub(vl_stack, "carol")
    sampler = vl_stack.client("carol").create_sampling_client(base_model=vl_stack.model)
    assert "not one of your uploaded images" in refused(other.Sample, service_pb2.SampleRequest(
        sampler_id=sampler.sampler_id, prompt=image_prompt(ptr(asset.location)), num_samples=1, sampling_params=GREEDY))


def test_compute_logprobs_has_one_position_per_token_of_the_flattened_prompt(vl_stack, world):
    prompt = image_prompt(img(png_bytes("red"), expected=4), img(png_bytes("blue", (128, 64))))
    answer = world["stub"].ComputeLogprobs(service_pb2.ComputeLogprobsRequest(sampler_id=world["sampler"], prompt=prompt), timeout=120)
    logprobs = convert.logprobs_list(answer.logprobs)
    assert len(logprobs) == 3 + 4 + 2 + 8 + 2 and logprobs[0] is None and all(v is not None and v <= 0 for v in logprobs[1:])


def test_forward_backward_with_an_image_counts_its_image_tokens(vl_stack, world):
    stub, url = world["stub"], vl_stack.database_url
    client = world["client"]
    run = client.training_client(world["run"])
    tokens_before = stub.GetUsage(service_pb2.GetUsageRequest(), timeout=60).tokens_trained
    model_input = ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2, START]), ImageChunk(data=png_bytes("green"), format="png",
                                                                                                  expected_tokens=4),
                                     types.EncodedTextChunk(tokens=[END, 3, 4])])
    n = model_input.length
    assert n == 10
    datum = Datum(model_input=model_input, loss_fn_inputs={"target_tokens": np.full(n, 7, np.int64),
                                                           "weights": np.ones(n, np.float32)})
    out = run.forward_backward([datum], "cross_entropy").result()
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == n and np.isfinite(out.metrics["loss:sum"])
    assert stub.GetUsage(service_pb2.GetUsageRequest(), timeout=60).tokens_trained == tokens_before + n
    assert request_rows(url, world["run"])[-1][1:] == ("forward_backward", "done")
