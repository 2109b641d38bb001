"""Images as the HTTP clients send them -> Temper's image chunks. Pure functions: no network, no state.

Three shapes arrive: the Tinker SDK's chunks (JSON: ``{"type": "image", "data": base64, "format",
"expected_tokens"}`` and ``{"type": "image_asset_pointer", "location", "format", "expected_tokens"}``;
protobuf: tinker_wire.ImageChunk), OpenAI's ``image_url`` content parts with a ``data:`` URL, and
Anthropic's ``image`` blocks with a base64 source. They are unwrapped here (base64, media type,
format); what the bytes are (a whole PNG or JPEG within the limits) and how many tokens an image
becomes are for services/models/images.py, the one image path, which the scheduler calls and the
gateway calls early (``check_images``, chat_prompt.py). Audio (dmel) is refused here, with the reason.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any, Mapping

from temper.common.errors import ResourceExhausted, TemperError
from temper.common.strings import shown
from temper.services.gateway import fields
from temper.services.gateway.errors import GatewayError, invalid
from temper.services.models.images import IMAGE_FORMATS, POINTER_SCHEME, ImageLimits, open_image
from temper.v1 import types_pb2

# what an image's base64 may take in a JSON body: the body limit bounds it anyway (body_limit.py)
MAX_BASE64_CHARS = 1 << 30
_MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}
_SHA256 = re.compile(r"[0-9a-f]{64}")
REMOTE_REFUSED = "remote image URLs are not fetched; send a data: URL (data:image/png;base64,...)"
AUDIO_REFUSED = "audio (dmel) chunks are not served: no open model Temper serves takes audio"


@dataclass(frozen=True)
class ImageBytes:
    """An image unwrapped from a request: its bytes and format ("png" | "jpeg"), not yet checked."""

    data: bytes
    format: str


def decode_base64(value: Any, label: str) -> bytes:
    """Standard base64 (as the SDK, OpenAI and Anthropic send it), whitespace allowed, padding required."""
    if not isinstance(value, str):
        raise invalid(f"{label} must be a base64 string")
    if len(value) > MAX_BASE64_CHARS:
        raise invalid(f"{label} is {len(value)} characters long (at most {MAX_BASE64_CHARS})")
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f"{label} is not valid base64 ({exc})") from None


def image_format(value: Any, label: str) -> str:
    if value not in IMAGE_FORMATS:
        raise invalid(f"{label} must be one of {list(IMAGE_FORMATS)}, got {shown(str(value), 20)}")
    return value


def _expected_tokens(chunk: Mapping[str, Any], where: str) -> dict:
    n = fields.integer(chunk, "expected_tokens", 0, fields.INT32[1], default=None, where=where)
    return {} if n is None else {"expected_tokens": n}


def pointer_location(value: Any, label: str) -> str:
    """``temper-image://<sha256>``, an image the caller uploaded; a URL or a server path is refused here
    already (the scheduler also checks that the image is the caller's own)."""
    location = fields.text(value, label, 200)
    digest = location.removeprefix(POINTER_SCHEME)
    if not location.startswith(POINTER_SCHEME) or not _SHA256.fullmatch(digest):
        raise invalid(f"{label} must be {POINTER_SCHEME}<sha256>, an image you uploaded (POST /api/v1/images); "
                      f"URLs and server paths are not read, got {shown(location, 60)}")
    return location


def chunk_from_json(chunk: Mapping[str, Any], kind: str, where: str) -> types_pb2.ModelInputChunk:
    """One of the SDK's non-text chunks (``type`` ``kind``) as Temper's ModelInputChunk."""
    prefix = f"{where}."
    if kind == "image":
        image = types_pb2.ImageChunk(data=decode_base64(chunk.get("data"), f"{where}.data"),
                                     format=image_format(chunk.get("format"), f"{where}.format"),
                                     **_expected_tokens(chunk, prefix))
        return types_pb2.ModelInputChunk(image=image)
    if kind == "image_asset_pointer":
        pointer = types_pb2.ImageAssetPointerChunk(location=pointer_location(chunk.get("location"), f"{where}.location"),
                                                   format=image_format(chunk.get("format"), f"{where}.format"),
                                                   **_expected_tokens(chunk, prefix))
        return types_pb2.ModelInputChunk(image_asset_pointer=pointer)
    if kind == "dmel":
        raise invalid(f"{where}: {AUDIO_REFUSED}")
    raise invalid(f"{where}: chunk type {shown(kind)} is not one of encoded_text, image, image_asset_pointer")


def chunk_from_wire(chunk, where: str) -> types_pb2.ModelInputChunk:
    """A tinker_wire.Chunk that is not text (image or dmel) as Temper's ModelInputChunk."""
    kind = chunk.WhichOneof("chunk")
    if kind == "image":
        msg = chunk.image
        if msg.HasField("override_dimensions"):
            raise invalid(f"{where}: image override_dimensions is not supported by Temper (the image's own size is used)")
        image = types_pb2.ImageChunk(data=msg.data, format=image_format(msg.format, f"{where}.format"))
        if msg.HasField("expected_tokens"):
            if msg.expected_tokens < 0:
                raise invalid(f"{where}.expected_tokens must not be negative")
            image.expected_tokens = msg.expected_tokens
        return types_pb2.ModelInputChunk(image=image)
    if kind == "dmel":
        raise invalid(f"{where}: {AUDIO_REFUSED}")
    raise invalid(f"{where}: an empty chunk (set encoded_text or image)")


def check_images(model_inputs, limits: ImageLimits, what: str = "model_input") -> None:
    """Each ImageChunk of ``model_inputs`` through the one image path's checks (``open_image``), before
    the scheduler sees it: an image over a size limit is refused here as final (413), since the
    scheduler's RESOURCE_EXHAUSTED would read as backpressure, which the gateway resends. Pointers are
    the scheduler's to resolve (their uploads were checked). CPU work: call it in a thread."""
    for i, model_input in enumerate(model_inputs):
        for j, chunk in enumerate(model_input.chunks):
            if chunk.WhichOneof("chunk") == "image":
                checked(chunk.image.data, chunk.image.format, limits, f"{what} {i} chunk {j}")


def checked(data: bytes, fmt: str, limits: ImageLimits, what: str) -> tuple[int, int]:
    """``open_image``'s (width, height), its refusals as the gateway answers them (too large: 413)."""
    try:
        return open_image(data, fmt, limits, what)
    except ResourceExhausted as exc:
        raise GatewayError(exc.code, exc.message, status=413) from None
    except TemperError as exc:
        raise GatewayError.of(exc) from None


# ---- chat APIs ----------------------------------------------------------------------------------------

def _media_format(media_type: Any, label: str) -> str:
    fmt = _MEDIA_TYPES.get(media_type.lower()) if isinstance(media_type, str) else None
    if fmt is None:
        raise invalid(f"{label}: media type {shown(str(media_type), 40)} is not supported: image/png or image/jpeg")
    return fmt


def data_url(url: Any, label: str) -> ImageBytes:
    """``data:image/png;base64,...`` -> the image; remote and other URLs are refused, never fetched."""
    if not isinstance(url, str) or not url:
        raise invalid(f"{label} must be a data: URL string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise invalid(f"{label}: {REMOTE_REFUSED}")
    if scheme != "data":
        raise invalid(f"{label}: only data: URLs are accepted (data:image/png;base64,...), got {shown(url, 40)}")
    head, comma, payload = url[5:].partition(",")
    params = head.split(";")
    if not comma or "base64" not in (p.strip().lower() for p in params[1:]):
        raise invalid(f"{label}: a data: URL of an image must be base64 (data:image/png;base64,...)")
    return ImageBytes(decode_base64(payload, f"{label} (base64 payload)"), _media_format(params[0].strip(), label))


def openai_image(part: Mapping[str, Any], label: str) -> ImageBytes:
    """An OpenAI ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` part (a bare URL
    string as ``image_url`` is taken too); ``detail`` changes nothing: the model's processor sizes images."""
    source = part.get("image_url")
    url = source.get("url") if isinstance(source, Mapping) else source
    return data_url(url, f"{label}.image_url.url")


def anthropic_image(block: Mapping[str, Any], label: str) -> ImageBytes:
    """An Anthropic ``{"type": "image", "source": {"type": "base64", "media_type", "data"}}`` block."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise invalid(f"{label}.source must be an object: {{type: base64, media_type, data}}")
    kind = source.get("type")
    if kind == "url":
        raise invalid(f"{label}.source: remote image URLs are not fetched; send a base64 source")
    if kind != "base64":
        raise invalid(f"{label}.source.type must be base64, got {shown(str(kind), 20)}")
    fmt = _media_format(source.get("media_type"), f"{label}.source.media_type")
    return ImageBytes(decode_base64(source.get("data"), f"{label}.source.data"), fmt)
