"""Model inputs with images on the scheduler's request path: flattened through the one image path
(services/models/images.py) with the base model's processor, as its workers report it, and the
scheduler's image limits, before anything is admitted, pushed or counted.

A sampling prompt's image pointers resolve only to the calling tenant's own uploads (db/images.py):
another tenant's image, one never uploaded, a server path or a URL is refused alike, naming the
location and never saying whether the bytes exist elsewhere. The samplers get the prompt flattened
(its tokens) and, when it has images, the prompt itself with every image as an ImageChunk of its
bytes and its N (``images.image_chunk``): they never see a pointer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from temper.common.errors import InvalidArgument
from temper.common.strings import shown
from temper.services.models.images import (POINTER_SCHEME, FlatInput, ImageLimits, VisionProcessor, flatten,
                                           image_chunk)
from temper.v1 import types_pb2

IMAGE_KINDS = ("image", "image_asset_pointer")
SHA256 = re.compile(r"[0-9a-f]{64}")


def has_images(model_input: types_pb2.ModelInput) -> bool:
    return any(chunk.WhichOneof("chunk") in IMAGE_KINDS for chunk in model_input.chunks)


def vision_of(info) -> VisionProcessor | None:
    """The base model's image processor from a worker's ModelInfo / SamplerModelInfo (None: text only).
    Built once per model (cached in images.py); the first build imports transformers, so callers on the
    event loop build it in a thread."""
    return VisionProcessor.from_info(info.vision) if info.HasField("vision") else None


def serves_images(info) -> bool:
    """Whether a worker's ModelInfo / SamplerModelInfo is a vision-language model's."""
    return info.HasField("vision") and bool(info.vision.image_processor_json)


def image_sha256(location: str, what: str = "prompt") -> str:
    """The sha256 of a location "temper-image://<sha256>"; anything else is refused by name."""
    digest = location[len(POINTER_SCHEME):] if location.startswith(POINTER_SCHEME) else None
    if digest is None or not SHA256.fullmatch(digest):
        raise InvalidArgument(f"{what}: image location {shown(location, 100)} is not an uploaded image's "
                              f"({POINTER_SCHEME}<sha256> from UploadImage); paths and URLs are not fetched")
    return digest


def pointer_digests(model_input: types_pb2.ModelInput) -> list[str]:
    """The well-formed pointers' sha256s (a malformed one is refused by ``flatten``, naming its chunk)."""
    digests = []
    for chunk in model_input.chunks:
        if chunk.WhichOneof("chunk") == "image_asset_pointer":
            location = chunk.image_asset_pointer.location
            digest = location[len(POINTER_SCHEME):]
            if location.startswith(POINTER_SCHEME) and SHA256.fullmatch(digest):
                digests.append(digest)
    return digests


def owned_images(uploads: dict[str, tuple[str, bytes]]):
    """``flatten``'s resolve_pointer over the tenant's own uploads (sha256 -> (format, bytes))."""

    def resolve(location: str, fmt: str) -> bytes:
        found = uploads.get(image_sha256(location))
        if found is None:
            raise InvalidArgument(f"prompt: image {shown(location, 100)} is not one of your uploaded images (UploadImage)")
        uploaded_as, data = found
        if fmt != uploaded_as:
            raise InvalidArgument(f"prompt: image {shown(location, 100)} was uploaded as {uploaded_as}, the chunk says "
                                  f"format {shown(fmt, 20)}")
        return data

    return resolve


@dataclass
class CheckedPrompt:
    tokens: np.ndarray                       # the prompt as the model sees it (images as their N tokens)
    prompt: types_pb2.ModelInput | None      # for the samplers when it has images; None: text only


def check_prompt(prompt: types_pb2.ModelInput, vision: VisionProcessor | None, limits: ImageLimits,
                 uploads: dict[str, tuple[str, bytes]], model: str) -> CheckedPrompt:
    """A sampling prompt flattened and checked (InvalidArgument / ResourceExhausted naming the chunk).
    CPU work when it has images: called in a thread."""
    flat = flatten(prompt, vision, limits, "prompt", resolve_pointer=owned_images(uploads), model=model)
    return CheckedPrompt(flat.tokens, worker_prompt(prompt, flat) if flat.images else None)


def worker_prompt(prompt: types_pb2.ModelInput, flat: FlatInput) -> types_pb2.ModelInput:
    """The prompt the samplers get: text chunks as sent, each image (a pointer resolved) as an
    ImageChunk of its bytes with expected_tokens = N."""
    images = iter(flat.images)
    out = types_pb2.ModelInput()
    for chunk in prompt.chunks:
        if chunk.WhichOneof("chunk") in IMAGE_KINDS:
            out.chunks.append(image_chunk(next(images)))
        else:
            out.chunks.append(chunk)
    return out

