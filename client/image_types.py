"""The image types of temper.client (Tinker's image chunks, uploads, and a model's vision facts),
public through temper.client.types."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal


ImageFormat = Literal["png", "jpeg"]


def _image_length(chunk, kind: str) -> int:
    if chunk.expected_tokens is None:
        raise ValueError(f"{kind} expected_tokens needs to be set in order to compute the length (the image tokens "
                         f"the model makes of it: UploadImage with base_model, or the model's image processor, tells it)")
    return chunk.expected_tokens


@dataclass
class ImageChunk:
    """An image the model sees as ``expected_tokens`` image tokens (PNG or JPEG bytes, as the file is)."""

    data: bytes
    format: ImageFormat
    expected_tokens: int | None = None  # checked by the server against the model's own image processor
    type: Literal["image"] = "image"

    @property
    def length(self) -> int:
        return _image_length(self, "ImageChunk")


@dataclass
class ImageAssetPointerChunk:
    """An image you uploaded (``ServiceClient.upload_image``), by its location "temper-image://<sha256>".
    Sampling only, as in the Tinker SDK."""

    location: str
    format: ImageFormat
    expected_tokens: int | None = None
    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    @property
    def length(self) -> int:
        return _image_length(self, "ImageAssetPointerChunk")


@dataclass
class ImageAsset:
    """An image you uploaded (``ServiceClient.upload_image``); ``location`` goes in an ImageAssetPointerChunk."""

    location: str                 # "temper-image://<sha256>"
    format: str                   # "png" | "jpeg"
    width: int
    height: int
    size_bytes: int
    time: datetime
    created: bool = False         # upload_image: False when you had already uploaded these bytes
    expected_tokens: int | None = None  # upload_image with base_model: the image tokens that model makes of it

    def pointer(self) -> "ImageAssetPointerChunk":
        return ImageAssetPointerChunk(location=self.location, format=self.format, expected_tokens=self.expected_tokens)


@dataclass
class VisionInfo:
    """A vision-language model's image token ids and its own image processor (preprocessor_config.json),
    as its workers report them: what an image's ``expected_tokens`` is counted with."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    image_processor_json: str

    def count_image_tokens(self, width: int, height: int) -> int:
        """The image tokens a width x height image becomes on this model (the server's own count:
        services/models/images.py; imports transformers on first use)."""
        from temper.services.models.images import VisionProcessor
        from temper.v1 import types_pb2

        return VisionProcessor.from_info(types_pb2.VisionInfo(
            image_token_id=self.image_token_id, vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id, image_processor_json=self.image_processor_json)).count(width, height)
