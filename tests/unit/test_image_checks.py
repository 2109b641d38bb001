"""The scheduler's and the client's side of images (issue 30), without a model: the image limits as
settings, sampling prompts checked and flattened with the model's processor (pointers resolved to the
tenant's own uploads only, the sampler's prompt built with each image's N), forward_backward refused
at admission before any row or trainer call, and the client's chunk types."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from fakes_scheduler import FakeBackends, FakeTrainer, build
from fixtures_stack import png_bytes
from temper.client import convert, types
from temper.common.errors import InvalidArgument, ResourceExhausted
from temper.scheduler.api import image_inputs
from temper.scheduler.api.servicer import TemperServicer
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.services.models.images import ImageLimits, VisionProcessor
from temper.v1 import service_pb2, trainer_pb2, types_pb2

# Qwen3's special ids and the tiny models' processor (services/models/tiny_vision.py): 64x64 -> 4 tokens
IMAGE, START, END = 151655, 151652, 151653
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True, "do_normalize": True,
             "do_convert_rgb": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": 16, "merge_size": 2,
             "temporal_patch_size": 2, "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}}
VISION_INFO = types_pb2.VisionInfo(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
                                   image_processor_json=json.dumps(PROCESSOR))
VOCAB = 151936


@pytest.fixture(scope="module")
def vision() -> VisionProcessor:
    return VisionProcessor.from_info(VISION_INFO)


def text(*tokens: int) -> types_pb2.ModelInputChunk:
    return convert.chunk_to_proto(types.EncodedTextChunk(tokens=list(tokens)))


def image(data: bytes, fmt: str = "png", expected: int | None = None) -> types_pb2.ModelInputChunk:
    return convert.chunk_to_proto(types.ImageChunk(data=data, format=fmt, expected_tokens=expected))


def pointer(location: str, fmt: str = "png", expected: int | None = None) -> types_pb2.ModelInputChunk:
    return convert.chunk_to_proto(types.ImageAssetPointerChunk(location=location, format=fmt, expected_tokens=expected))


# ---- settings -----------------------------------------------------------------------------------

def test_every_process_reads_its_image_limits_from_its_own_prefix(monkeypatch):
    from temper.services.gateway.settings import GatewaySettings
    from temper.services.sampler.settings import SamplerSettings
    from temper.services.trainer.settings import TrainerSettings

    assert SchedulerSettings().image_limits() == ImageLimits()  # the defaults are images.py's
    for cls, prefix in ((SchedulerSettings, "TEMPER_SCHEDULER_"), (TrainerSettings, "TEMPER_TRAINER_"),
                        (SamplerSettings, "TEMPER_SAMPLER_"), (GatewaySettings, "TEMPER_GATEWAY_")):
        monkeypatch.setenv(f"{prefix}IMAGE_MAX_BYTES", "1234")
        monkeypatch.setenv(f"{prefix}IMAGE_MAX_PIXELS", "4096")
        monkeypatch.setenv(f"{prefix}IMAGE_MAX_SIDE", "100")
        monkeypatch.setenv(f"{prefix}IMAGE_MAX_IMAGES", "3")
        kwargs = {"internal_auth": "disabled"} if cls in (TrainerSettings, SamplerSettings) else {}
        assert cls(**kwargs).image_limits() == ImageLimits(max_bytes=1234, max_pixels=4096, max_side=100, max_images=3), cls


# ---- sampling prompts ---------------------------------------------------------------------------

def test_a_prompt_with_an_image_and_a_pointer_is_flattened_and_the_sampler_gets_their_bytes(vision):
    red, blue = png_bytes("red"), png_bytes("blue", (128, 64))
    digest = image_inputs.image_sha256(f"temper-image://{hashlib.sha256(blue).hexdigest()}")
    prompt = types_pb2.ModelInput(chunks=[text(1, START), image(red, expected=4), text(END, START),
                                          pointer(f"temper-image://{digest}"), text(END)])
    checked = image_inputs.check_prompt(prompt, vision, ImageLimits(), {digest: ("png", blue)}, "m")
    n_blue = vision.count(128, 64)
    assert n_blue == 8 and checked.tokens.tolist() == [1, START, *[IMAGE] * 4, END, START, *[IMAGE] * n_blue, END]
    sent = checked.prompt
    assert [c.WhichOneof("chunk") for c in sent.chunks] == ["encoded_text", "image", "encoded_text", "image", "encoded_text"]
    assert (sent.chunks[1].image.data, sent.chunks[1].image.expected_tokens) == (red, 4)
    assert (sent.chunks[3].image.data, sent.chunks[3].image.format, sent.chunks[3].image.expected_tokens) == (blue, "png", n_blue)


def test_two_images_with_no_token_between_are_refused(vision):
    # Qwen-VL's rotary positions find an image as one run of image tokens: touching images would be read as one
    prompt = types_pb2.ModelInput(chunks=[text(1), image(png_bytes()), image(png_bytes("blue")), text(2)])
    with pytest.raises(InvalidArgument, match="chunk 2: an image right after another"):
        image_inputs.check_prompt(prompt, vision, ImageLimits(), {}, "m")


def test_a_text_prompt_goes_to_the_sampler_as_tokens_only(vision):
    checked = image_inputs.check_prompt(types_pb2.ModelInput(chunks=[text(5, 6, 7)]), vision, ImageLimits(), {}, "m")
    assert checked.tokens.tolist() == [5, 6, 7] and checked.prompt is None


@pytest.mark.parametrize("location", ["/etc/passwd", "file:///etc/passwd", "https://example.com/a.png", "http://x/y.png",
                                      "temper-image://abc", "temper-image://../../etc/passwd", "temper-image://" + "A" * 64])
def test_a_pointer_that_is_not_an_upload_location_is_refused_by_name(vision, location):
    prompt = types_pb2.ModelInput(chunks=[text(1), pointer(location)])
    with pytest.raises(InvalidArgument, match="paths and URLs are not fetched"):
        image_inputs.check_prompt(prompt, vision, ImageLimits(), {}, "m")
    assert image_inputs.pointer_digests(prompt) == []  # nothing of it is looked up


def test_a_pointer_to_an_image_the_tenant_did_not_upload_is_refused_naming_the_location(vision):
    mine, theirs = "a" * 64, "b" * 64
    uploads = {mine: ("png", png_bytes())}
    prompt = types_pb2.ModelInput(chunks=[pointer(f"temper-image://{theirs}")])
    with pytest.raises(InvalidArgument, match=f"'temper-image://{theirs}' is not one of your uploaded images"):
        image_inputs.check_prompt(prompt, vision, ImageLimits(), uploads, "m")
    wrong_format = types_pb2.ModelInput(chunks=[pointer(f"temper-image://{mine}", "jpeg")])
    with pytest.raises(InvalidArgument, match="was uploaded as png, the chunk says format 'jpeg'"):
        image_inputs.check_prompt(wrong_format, vision, ImageLimits(), uploads, "m")


@pytest.mark.parametrize("chunk, error, match", [
    (lambda: image(png_bytes(), expected=5), InvalidArgument, "expected_tokens is 5 but .* makes 4 image tokens"),
    (lambda: image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), InvalidArgument, "corrupt PNG"),
    (lambda: image(png_bytes()[:60]), InvalidArgument, "corrupt PNG"),
    (lambda: image(png_bytes(fmt="GIF"), "gif"), InvalidArgument, "format 'gif' is not one of"),
    (lambda: image(png_bytes(fmt="JPEG"), "png"), InvalidArgument, "not a PNG file"),
    (lambda: image(png_bytes(size=(300, 10))), ResourceExhausted, "side over the limit of 200"),
    (lambda: image(png_bytes(size=(150, 150))), ResourceExhausted, "pixels exceed the limit of 20000"),
    (lambda: image(png_bytes(size=(64, 64), color="white") + b"\x00" * 3000), ResourceExhausted, "exceed the limit of 2000 bytes"),
    (lambda: types_pb2.ModelInputChunk(dmel=types_pb2.DmelChunk(dmel=b"\x00" * 8)), InvalidArgument, "audio \\(dmel\\)"),
])
def test_bad_images_are_refused_with_a_message_naming_the_problem(vision, chunk, error, match):
    limits = ImageLimits(max_bytes=2000, max_pixels=20000, max_side=200, max_images=2)
    with pytest.raises(error, match=match):
        image_inputs.check_prompt(types_pb2.ModelInput(chunks=[text(1), chunk()]), vision, limits, {}, "m")


def test_an_image_on_a_text_only_model_is_refused_naming_the_model():
    prompt = types_pb2.ModelInput(chunks=[text(1), image(png_bytes())])
    with pytest.raises(InvalidArgument, match="smol takes text only"):
        image_inputs.check_prompt(prompt, None, ImageLimits(), {}, "smol")


def test_the_model_reports_vision_or_not():
    assert image_inputs.serves_images(trainer_pb2.ModelInfo(vision=VISION_INFO))
    assert not image_inputs.serves_images(trainer_pb2.ModelInfo(base_model="text"))
    assert image_inputs.vision_of(trainer_pb2.ModelInfo(base_model="text")) is None


# ---- forward_backward at admission --------------------------------------------------------------

def fb_request(run_id: str, seq: int, chunks, n: int) -> service_pb2.ForwardBackwardRequest:
    datum = types_pb2.Datum(model_input=types_pb2.ModelInput(chunks=chunks))
    datum.loss_fn_inputs["target_tokens"].CopyFrom(convert.tensor_to_proto(types.TensorData.from_numpy(np.ones(n, np.int64))))
    datum.loss_fn_inputs["weights"].CopyFrom(convert.tensor_to_proto(types.TensorData.from_numpy(np.ones(n, np.float32))))
    return service_pb2.ForwardBackwardRequest(training_run_id=run_id, seq_id=seq, data=[datum], loss_fn="cross_entropy")


def _admitted(vision_info: types_pb2.VisionInfo | None, requests):
    """Each request sent in order to a servicer over fakes whose trainer reports ``vision_info``:
    the outcomes, the request rows written, what the trainer applied, the check's threads."""
    info = trainer_pb2.ModelInfo(base_model="fake-model", tokenizer_id="fake", vocab_size=VOCAB, max_context_length=12)
    if vision_info is not None:
        info.vision.CopyFrom(vision_info)

    async def main():
        s = build(trainer=FakeTrainer(info=info))
        s.store.add_run("r", "alice")
        api = TemperServicer(s.store, FakeBackends(s.trainer), s.admission.runs, s.admission)
        task = asyncio.create_task(s.loop.run_forever())
        token = set_caller("alice")
        outcomes = []
        try:
            for request in requests:
                try:
                    outcomes.append(await asyncio.wait_for(api.ForwardBackward(request, None), 10))
                except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
                    outcomes.append(exc)
        finally:
            reset_caller(token)
            task.cancel()
        return outcomes, dict(s.store.requests), list(s.trainer.applied)

    return asyncio.run(main())


def test_forward_backward_with_a_bad_image_is_refused_before_any_row_or_trainer_call():
    bad = [
        (fb_request("r", 1, [text(1), image(png_bytes(), expected=7)], 5), InvalidArgument, "expected_tokens is 7 but"),
        (fb_request("r", 2, [text(1), image(b"\x89PNG\r\n\x1a\n garbage")], 5), InvalidArgument, "corrupt PNG"),
        (fb_request("r", 3, [text(1), pointer("temper-image://" + "a" * 64)], 5), InvalidArgument, "for sampling only"),
        (fb_request("r", 4, [text(1), image(png_bytes(size=(128, 128)), expected=16)], 17), InvalidArgument,
         "17 tokens exceed the model's context length 12"),
    ]
    outcomes, rows, applied = _admitted(VISION_INFO, [request for request, _, _ in bad])
    for outcome, (_, error, match) in zip(outcomes, bad):
        assert isinstance(outcome, error) and re.search(match, str(outcome)), outcome
    assert rows == {} and applied == []


def test_an_image_to_a_text_only_model_is_refused_at_admission():
    outcomes, rows, applied = _admitted(None, [fb_request("r", 1, [text(1), image(png_bytes(), expected=4)], 5)])
    assert isinstance(outcomes[0], InvalidArgument) and "takes text only" in str(outcomes[0])
    assert rows == {} and applied == []


def test_an_image_datum_is_admitted_with_its_flattened_token_count():
    outcomes, rows, applied = _admitted(VISION_INFO, [fb_request("r", 1, [text(1, 2), image(png_bytes(), expected=4)], 6)])
    assert not isinstance(outcomes[0], Exception), outcomes[0]
    assert [row.num_tokens for row in rows.values()] == [6]  # 2 text tokens + the image's 4
    assert applied == [("r", 1)]


def test_a_check_with_images_runs_off_the_event_loop():
    threads = []

    async def main():
        s = build()
        s.store.add_run("r", "alice")
        loop_thread = threading.get_ident()

        def check(run):
            threads.append(threading.get_ident() != loop_thread)
            raise InvalidArgument("refused")

        from temper.scheduler.planning.work import WorkKind
        for offload in (True, False):
            with pytest.raises(InvalidArgument):
                await s.admission.submit("r", 1 if offload else 2, WorkKind.FORWARD_BACKWARD,
                                         fb_request("r", 1 if offload else 2, [text(1)], 1), check, offload=offload)

    asyncio.run(main())
    assert threads == [True, False]


# ---- the client ---------------------------------------------------------------------------------

def test_the_client_counts_image_tokens_and_says_when_it_cannot():
    mixed = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.ImageChunk(data=b"x", format="png", expected_tokens=4),
                                     types.ImageAssetPointerChunk(location="temper-image://" + "a" * 64, format="jpeg",
                                                                  expected_tokens=9)])
    assert mixed.length == 15
    with pytest.raises(ValueError, match="to_ints only supported"):
        mixed.to_ints()
    unknown = mixed.append(types.ImageChunk(data=b"y", format="png"))
    with pytest.raises(ValueError, match="ImageChunk expected_tokens needs to be set"):
        unknown.length
    back = convert.model_input_from_proto(convert.model_input_to_proto(unknown))
    assert back == unknown  # bytes, formats, locations and expected_tokens (set or not) survive the wire


def test_the_client_imports_without_pillow_or_torch():
    code = ("import sys, temper.client\nfrom temper.client import ImageChunk, ImageAssetPointerChunk, ServiceClient\n"
            "print(','.join(m for m in ('PIL', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_upload_image_tells_png_from_jpeg_by_the_bytes():
    from temper.client.service_client import _image_format

    assert _image_format(png_bytes()) == "png" and _image_format(png_bytes(fmt="JPEG")) == "jpeg"
    with pytest.raises(ValueError, match="neither PNG nor JPEG"):
        _image_format(b"GIF89a")
