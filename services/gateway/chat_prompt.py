"""A chat's messages -> the prompt Sample takes, images included.

The model's chat template renders each image part as its placeholder (Qwen-VL: ``<|vision_start|>
<|image_pad|><|vision_end|>``, one image token per image). The rendered text is tokenized and each of
those image tokens is replaced by the image itself (an ImageChunk): the model input keeps the
vision-start and vision-end tokens as text, and the workers expand the image into its N image tokens
(services/models/images.py: flatten). The token ids are the model's (its VisionInfo, read from its
config by images.VisionProcessor), never written here. Each image is checked early with the one image
path (``open_image``) and counted with the model's processor, so the prompt's length (the context
left for max_tokens, ``usage``) is what the model sees; ``expected_tokens`` is left unset, so the
scheduler's own count is the one that holds.

Messages reach here as openai_convert / anthropic_convert leave them: content a string, or a list of
``{"type": "text", "text"}`` and ``{"type": "image", "image": ImageBytes}`` parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from temper.common.codec import encode_tokens
from temper.common.errors import ResourceExhausted
from temper.services.gateway.errors import GatewayError, invalid
from temper.services.gateway.image_parts import ImageBytes, checked
from temper.services.models.images import DEFAULT_LIMITS, ImageLimits, VisionProcessor
from temper.v1 import types_pb2


@dataclass
class ChatPrompt:
    """A prompt with images: the model input to send, and its length as the model sees it."""

    model_input: types_pb2.ModelInput
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass
class ChatModel:
    """What rendering needs of a model: its tokenizer, and its image processor when it takes images
    (``vision``), or why the gateway has none (``no_vision``: a text-only model, or a folder not here)."""

    name: str
    tokenizer: Any
    vision: VisionProcessor | None = None
    no_vision: str = "it is a text-only model"


def split_images(messages: list[dict]) -> tuple[list[dict], list[ImageBytes]]:
    """The messages as the template takes them (image parts as ``{"type": "image"}``) and the images
    in the order the template renders them (message by message, part by part)."""
    out, images = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "image":
                    images.append(part["image"])
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


def render(model: ChatModel, messages: list[dict], continued: bool = False,
           limits: ImageLimits = DEFAULT_LIMITS) -> list[int] | ChatPrompt:
    """The prompt: token ids for a text-only chat (as before images), a ChatPrompt for one with images.
    ``continued``: the last (assistant) message is continued instead of a new turn begun."""
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise invalid(f"{model.name} has no chat template: use /v1/completions")
    templated, images = split_images(messages)
    if images and model.vision is None:
        raise invalid(f"{model.name} takes no images here: {model.no_vision}")
    if len(images) > limits.max_images:
        raise GatewayError(ResourceExhausted.code, f"{len(images)} images in one chat: at most {limits.max_images}", status=413)
    checked = [_checked(image, i, model.vision, limits) for i, image in enumerate(images)]
    if continued:
        text = tokenizer.apply_chat_template(templated, tokenize=False, continue_final_message=True)
    else:
        text = tokenizer.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not images:
        return ids
    return _with_images(np.asarray(ids, dtype=np.int32), images, checked, model)


def _checked(image: ImageBytes, i: int, vision: VisionProcessor, limits: ImageLimits) -> int:
    """N, the image tokens image ``i`` becomes, once its bytes pass the one image path's checks."""
    return vision.count(*checked(image.data, image.format, limits, f"image {i}"))


def _with_images(ids: np.ndarray, images: list[ImageBytes], counts: list[int], model: ChatModel) -> ChatPrompt:
    tokens = model.vision.tokens
    at = np.flatnonzero(ids == tokens.image)
    if len(at) != len(images):
        raise invalid(f"the chat has {len(images)} images but {model.name}'s chat template rendered {len(at)} image "
                      f"tokens (id {tokens.image}): an image placeholder typed as text, or a template that drops images")
    chunks, start = [], 0
    for p, image in zip(at.tolist(), images):
        if p == 0 or ids[p - 1] != tokens.start or p + 1 >= len(ids) or ids[p + 1] != tokens.end:
            raise invalid(f"{model.name}'s chat template does not frame an image as vision start ({tokens.start}), "
                          f"image ({tokens.image}), vision end ({tokens.end})")
        chunks.append(_text(ids[start:p]))
        chunks.append(types_pb2.ModelInputChunk(image=types_pb2.ImageChunk(data=image.data, format=image.format)))
        start = p + 1
    chunks.append(_text(ids[start:]))
    return ChatPrompt(types_pb2.ModelInput(chunks=chunks), len(ids) - len(images) + sum(counts))


def _text(tokens: np.ndarray) -> types_pb2.ModelInputChunk:
    return types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens.tolist())))
