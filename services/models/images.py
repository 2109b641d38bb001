"""The one image path: every place that reads an image (the scheduler's and gateway's early checks, the
trainer, the sampler) calls this module, so the checks, the token count and the pixels cannot drift.

- ``open_image``: the bytes checked (format by magic bytes, size, dimensions, pixels, a full decode).
- ``VisionProcessor``: a model's image token ids (read from its config) and its own image processor
  (``preprocessor_config.json``); ``count`` is N, the image tokens an image becomes, and ``pixels``
  the tower's input (``pixel_values``, ``image_grid_thw``).
- ``flatten``: a ``ModelInput`` as the model sees it, each image as N image tokens (``FlatInput``).
- ``positions``: the multimodal rotary positions of right-padded rows, computed per row from the rows
  themselves (transformers' Qwen-VL models cache ``rope_deltas`` on the module between calls: a
  position computed here never reads that state, so nothing leaks across rows, tenants or calls).

Imports Pillow, numpy and protobuf at module level; transformers and torch only where a processor
is built or pixels are made, so the scheduler checks images without loading a model.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from temper.common.errors import HARD_LIMIT_PREFIX, InvalidArgument, ResourceExhausted, shown

if TYPE_CHECKING:  # protobuf where a message is built: the trainer's engine and numerics import no protobuf
    from temper.v1 import types_pb2

IMAGE_FORMATS = ("png", "jpeg")
_MAGIC = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",)}
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}
POINTER_SCHEME = "temper-image://"


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be (a process's settings fill these: ``common.settings.ImageSettings``)."""

    max_bytes: int = 10 << 20
    max_pixels: int = 4096 * 4096
    max_side: int = 8192
    max_images: int = 64          # per model input


DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class ImageInput:
    """One image of a flattened input: where its N image tokens start, N, and the checked file."""

    offset: int
    tokens: int
    data: bytes
    format: str
    width: int
    height: int

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the bytes: the same image in two rows is the same key (per-cycle caches)."""
        return hashlib.sha256(self.data).hexdigest()

    def image(self):
        """The decoded RGB image (decoded again: ImageInput is kept small and hashable)."""
        from PIL import Image
        with Image.open(io.BytesIO(self.data)) as img:
            return img.convert("RGB")


@dataclass
class FlatInput:
    """A model input as the model sees it: int32 tokens with each image as its N image tokens."""

    tokens: np.ndarray
    images: tuple[ImageInput, ...] = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.tokens)


def open_image(data: bytes, fmt: str, limits: ImageLimits = DEFAULT_LIMITS, what: str = "image"):
    """The image's (width, height) once its bytes are a whole PNG or JPEG within ``limits``:
    INVALID_ARGUMENT for a wrong format, corrupt bytes or bad dimensions, RESOURCE_EXHAUSTED for size."""
    if fmt not in IMAGE_FORMATS:
        raise InvalidArgument(f"{what}: format {shown(fmt, 20)} is not one of {list(IMAGE_FORMATS)}")
    if len(data) > limits.max_bytes:
        raise _over_limit("image_max_bytes", f"{what}: {len(data)} bytes exceed the limit of {limits.max_bytes} bytes per image")
    if not data:
        raise InvalidArgument(f"{what}: no image bytes")
    if not data.startswith(_MAGIC[fmt]):
        raise InvalidArgument(f"{what}: the bytes are not a {fmt.upper()} file (format says {fmt!r})")
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[_PIL_FORMATS[fmt]]) as img:
                width, height = img.size
                _check_dimensions(width, height, limits, what)
                img.load()  # the whole file decoded: a truncated or corrupt one fails here
    except (InvalidArgument, ResourceExhausted):
        raise
    except Image.DecompressionBombError as exc:
        raise _over_limit("image_max_pixels", f"{what}: {exc}") from None
    except Exception as exc:  # PIL raises many types for bad files (OSError, SyntaxError, ValueError, ...)
        detail = "not decodable" if isinstance(exc, Image.UnidentifiedImageError) else shown(str(exc), 80)
        raise InvalidArgument(f"{what}: corrupt {fmt.upper()} image ({type(exc).__name__}: {detail})") from None
    return width, height


def _check_dimensions(width: int, height: int, limits: ImageLimits, what: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidArgument(f"{what}: dimensions {width}x{height} must both be positive")
    if max(width, height) > limits.max_side:
        raise _over_limit("image_max_side", f"{what}: {width}x{height} has a side over the limit of {limits.max_side} pixels")
    if width * height > limits.max_pixels:
        raise _over_limit("image_max_pixels", f"{what}: {width}x{height} = {width * height} pixels exceed the limit of "
                                f"{limits.max_pixels} pixels per image")


def _over_limit(setting: str, message: str) -> ResourceExhausted:
    """A size limit: RESOURCE_EXHAUSTED marked as a hard limit (``HARD_LIMIT_PREFIX``), so that clients and
    the gateway raise it at once instead of resending it as backpressure (the same image never fits)."""
    return ResourceExhausted(f"{HARD_LIMIT_PREFIX}{setting}: {message}")


@dataclass(frozen=True)
class VisionTokens:
    image: int
    start: int
    end: int


class VisionProcessor:
    """A vision-language model's image token ids and its own image processor."""

    def __init__(self, tokens: VisionTokens, processor, processor_json: str):
        self.tokens = tokens
        self.processor = processor
        self.processor_json = processor_json
        self.merge_size = int(getattr(processor, "merge_size", 1) or 1)

    @classmethod
    def from_model(cls, config, folder: str) -> "VisionProcessor | None":
        """The processor of the model at ``folder`` (config: its transformers config); None for a
        text-only model. A vision family without a ``preprocessor_config.json`` is an error."""
        from temper.services.models.families import UnknownFamily, family_of

        try:
            layout = family_of(config).vision
        except UnknownFamily:
            return None
        if layout is None:
            return None
        tokens = VisionTokens(*(int(getattr(config, name)) for name in
                                (layout.image_token_field, layout.start_token_field, layout.end_token_field)))
        path = f"{folder}/preprocessor_config.json"
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"{folder}: a vision-language model needs its preprocessor_config.json ({exc})") from None
        return cls(tokens, _processor(text), text)

    @classmethod
    def from_info(cls, info: types_pb2.VisionInfo | None) -> "VisionProcessor | None":
        """What a worker reported (ModelInfo.vision); None when it reported none (a text-only model)."""
        if info is None or not info.image_processor_json:
            return None
        return _from_info(info.image_token_id, info.vision_start_token_id, info.vision_end_token_id,
                          info.image_processor_json)

    def info(self) -> types_pb2.VisionInfo:
        from temper.v1 import types_pb2
        return types_pb2.VisionInfo(image_token_id=self.tokens.image, vision_start_token_id=self.tokens.start,
                                    vision_end_token_id=self.tokens.end, image_processor_json=self.processor_json)

    def count(self, width: int, height: int) -> int:
        """N: the image tokens a width x height image becomes (the processor's patches over merge²)."""
        patches = self.processor.get_number_of_image_patches(height, width, images_kwargs={})
        return int(patches) // self.merge_size ** 2

    def pixels(self, images: list[ImageInput]) -> dict:
        """The vision tower's inputs for ``images`` in order: pixel_values and image_grid_thw (torch)."""
        out = self.processor(images=[image.image() for image in images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


# transformers' lazy imports are not thread-safe on first use: two request threads building a model's
# processor at once (the scheduler checks images in worker threads) raised ImportError in one of them
_BUILDING = threading.RLock()


def _from_info(image: int, start: int, end: int, processor_json: str) -> VisionProcessor:
    with _BUILDING:
        return _cached_from_info(image, start, end, processor_json)


@functools.lru_cache(maxsize=16)
def _cached_from_info(image: int, start: int, end: int, processor_json: str) -> VisionProcessor:
    return VisionProcessor(VisionTokens(image, start, end), _processor(processor_json), processor_json)


def _processor(text: str):
    with _BUILDING:
        return _build_processor(text)


def _build_processor(text: str):
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    config = json.loads(text)
    name = config.get("image_processor_type")
    cls = get_image_processor_class_from_name(name) if name else None
    if cls is not None and not _has_torchvision():
        # the same processor without torchvision (transformers would fall back to it with a warning)
        cls = get_image_processor_class_from_name(name.removesuffix("Fast") + "Pil") or cls
    if cls is None:
        raise ValueError(f"preprocessor_config.json names no image processor transformers knows ({name!r})")
    kwargs = {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    return cls(**kwargs)


def _has_torchvision() -> bool:
    import importlib.util
    return importlib.util.find_spec("torchvision") is not None


def flatten(model_input: types_pb2.ModelInput, vision: VisionProcessor | None, limits: ImageLimits = DEFAULT_LIMITS,
            what: str = "model_input", resolve_pointer: Callable[[str, str], bytes] | None = None,
            model: str = "the base model") -> FlatInput:
    """``model_input`` as the model sees it, every chunk checked (INVALID_ARGUMENT naming the chunk):
    text tokens as they are, each image as N image tokens after checking its bytes and that N equals
    ``expected_tokens`` when given. ``resolve_pointer(location, format)``: the bytes of the caller's
    own uploaded image (None: pointers are refused, as forward_backward does). Token ranges are the
    caller's to check."""
    from temper.common.codec import decode_tokens  # protobuf: not at import (see the TYPE_CHECKING import)

    parts, images, at, typed_image_tokens = [], [], 0, 0
    for i, chunk in enumerate(model_input.chunks):
        kind = chunk.WhichOneof("chunk")
        where = f"{what} chunk {i}"
        if kind == "encoded_text":
            tokens = decode_tokens(chunk.encoded_text.tokens)
            if vision is not None:
                typed_image_tokens += int(np.count_nonzero(tokens == vision.tokens.image))
        elif kind in ("image", "image_asset_pointer"):
            image = _image_chunk(chunk, kind, vision, limits, where, resolve_pointer, model, at)
            if images and images[-1].offset + images[-1].tokens == at:
                # the model finds an image as one run of image tokens: two touching would be read as one
                raise InvalidArgument(f"{where}: an image right after another, with no token between; separate images "
                                      f"with text (the model's vision end and start tokens, {vision.tokens.end} and "
                                      f"{vision.tokens.start})")
            if len(images) >= limits.max_images:
                raise _over_limit("image_max_images", f"{what}: more than {limits.max_images} images in one model input")
            images.append(image)
            tokens = np.full(image.tokens, vision.tokens.image, dtype=np.int32)
        elif kind == "dmel":
            raise InvalidArgument(f"{where}: audio (dmel) chunks are not served: no open model Temper serves takes audio")
        else:
            raise InvalidArgument(f"{where}: empty chunk (set encoded_text, image or image_asset_pointer)")
        parts.append(tokens)
        at += len(tokens)
    flat = np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, dtype=np.int32)
    if typed_image_tokens:
        # an image token typed as text would take features no image gave (the model raises mid-pass)
        raise InvalidArgument(f"{what}: token id {vision.tokens.image} (the image token) appears in text; images are "
                              f"sent as image chunks, which the server expands into their image tokens")
    return FlatInput(flat, tuple(images))


def _image_chunk(chunk, kind, vision, limits, where, resolve_pointer, model, offset) -> ImageInput:
    if vision is None:
        raise InvalidArgument(f"{where}: {model} takes text only; images need a vision-language base model")
    if kind == "image_asset_pointer":
        pointer = chunk.image_asset_pointer
        if resolve_pointer is None:
            raise InvalidArgument(f"{where}: image_asset_pointer chunks are for sampling only (send the image's bytes)")
        if not pointer.location.startswith(POINTER_SCHEME):
            raise InvalidArgument(f"{where}: image location {shown(pointer.location, 60)} is not an uploaded image "
                                  f"({POINTER_SCHEME}<sha256> from UploadImage); paths and URLs are not fetched")
        data, fmt, expected = resolve_pointer(pointer.location, pointer.format), pointer.format, pointer
    else:
        data, fmt, expected = chunk.image.data, chunk.image.format, chunk.image
    width, height = open_image(data, fmt, limits, where)
    n = vision.count(width, height)
    if expected.HasField("expected_tokens") and expected.expected_tokens != n:
        raise InvalidArgument(f"{where}: expected_tokens is {expected.expected_tokens} but the model's image processor "
                              f"makes {n} image tokens of this {width}x{height} image")
    return ImageInput(offset, n, bytes(data), fmt, width, height)


def image_chunk(image: ImageInput) -> types_pb2.ModelInputChunk:
    """The chunk that carries ``image`` (a resolved pointer becomes one for the workers)."""
    from temper.v1 import types_pb2
    return types_pb2.ModelInputChunk(image=types_pb2.ImageChunk(data=image.data, format=image.format,
                                                                expected_tokens=image.tokens))


def chunk_length(chunk: types_pb2.ModelInputChunk) -> int | None:
    """A chunk's length without decoding an image: its tokens, or an image's expected_tokens (None when
    an image does not say)."""
    kind = chunk.WhichOneof("chunk")
    if kind == "encoded_text":
        return len(chunk.encoded_text.tokens) // 4
    if kind in ("image", "image_asset_pointer"):
        given = getattr(chunk, kind)
        return given.expected_tokens if given.HasField("expected_tokens") else None
    return 0


def positions(model, ids, mask, grid_thw):
    """Multimodal rotary positions (3, B, T) of right-padded rows ``ids`` (B, T) with ``mask``, the
    images of all rows in row order with ``grid_thw`` (None: no image). Computed per row by the
    model's own ``get_rope_index`` (stateless), with its per-row offset past the prompt
    (``deltas``: next position = row length + delta), so no cached ``rope_deltas`` is read."""
    import torch

    inner = model.model
    image_id = int(model.config.image_token_id)
    token_types = (ids == image_id).to(torch.int32)
    pos, deltas = inner.get_rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=grid_thw,
                                       attention_mask=mask.long())
    return pos, deltas.reshape(-1)
