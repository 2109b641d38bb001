"""What a vision-language model's passes in the torch sampler take besides token ids: the images'
features and explicit multimodal rotary positions.

- Positions: every pass of a vision-language model gets explicit ``position_ids`` (3, B, T) from
  ``images.positions`` (the model's own stateless ``get_rope_index``, per row), text-only rows included,
  and each row's ``delta``: the decode step after a prompt of length n is at position n + delta + step.
  transformers' Qwen-VL models cache ``rope_deltas`` on the module when they compute positions
  themselves; with explicit positions they never do, so nothing of one request reaches the next.
- Features: each distinct image of a pass goes through the vision tower once, keyed by its digest (the
  bytes' sha256) and, when the row's adapter adapts the tower, by that adapter: two images that differ
  only in bytes never share features, and an adapter's tower LoRA applies to its own rows' images
  only. The features are handed to the model in row order as its ``mm_encoder_outputs`` (the tower's
  output, split per image), so the model's own placement of image features runs unchanged. The cache
  lives for one pass: the torch backend keeps no state between requests (no prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from temper.common.errors import FailedPrecondition, InvalidArgument
from temper.services.models import families, images as image_path
from temper.services.models.images import ImageInput


@dataclass
class PassInputs:
    """Keyword arguments of a prefill (``kwargs``) and each row's rotary offset past its prompt."""

    kwargs: dict
    deltas: torch.Tensor    # (B,) long: next position = row length + delta


def family_name(model) -> str:
    try:
        return families.family_of(model.config).name
    except families.UnknownFamily:
        return getattr(model.config, "model_type", "?")


def deterministic_refusal(model) -> str:
    """Why deterministic requests are refused on a vision-language model (FAILED_PRECONDITION text)."""
    return (f"deterministic mode does not cover the vision-language family {family_name(model)}: its vision tower and "
            f"multimodal rotary positions have no batch-invariant path (use a text-only base model for deterministic runs)")


def check_images(prompt: np.ndarray, images: tuple[ImageInput, ...], vision, model_name: str) -> None:
    """The prompt's image tokens are exactly its images' spans (INVALID_ARGUMENT otherwise): an image
    token without an image would take features no image gave, and the model would fail mid-pass."""
    if vision is None:
        if images:
            raise InvalidArgument(f"prompt: {model_name} takes text only; images need a vision-language base model")
        return
    expected = np.zeros(len(prompt), dtype=bool)
    for image in images:
        if image.offset < 0 or image.offset + image.tokens > len(prompt):
            raise InvalidArgument(f"prompt: an image's tokens [{image.offset}, {image.offset + image.tokens}) lie outside "
                                  f"the prompt's {len(prompt)} tokens")
        expected[image.offset:image.offset + image.tokens] = True
    if not np.array_equal(prompt == vision.tokens.image, expected):
        raise InvalidArgument(f"prompt: image token id {vision.tokens.image} appears where no image is (images are "
                              f"sent as image chunks, which are expanded into their image tokens)")


def check_deterministic(model, vision, deterministic: bool) -> None:
    if deterministic and vision is not None:
        raise FailedPrecondition(deterministic_refusal(model))


class _Features:
    """The vision tower's output of each distinct (tower adapter, image digest) of one pass."""

    def __init__(self, backend):
        self.backend = backend
        self._tower_marker = f".{families.family_of(backend.loaded.model.config).vision.tower}."
        self._output_type = None
        self.grid: dict[str, torch.Tensor] = {}                  # digest -> (3,) grid_thw
        self.embeds: dict[tuple[str | None, str], tuple] = {}    # (tower key, digest) -> (embeds, deepstack per layer)

    def tower_key(self, checkpoint_key: str | None) -> str | None:
        """The adapter whose tower LoRA these rows' images see (None: the base tower)."""
        adapter = self.backend.lora.adapters.get(checkpoint_key) if checkpoint_key else None
        if adapter is not None and any(self._tower_marker in name for name in adapter.params):
            return checkpoint_key
        return None

    def compute(self, wanted: list[tuple[str | None, ImageInput]]) -> None:
        """Runs the tower once per tower key over that key's new images."""
        todo: dict[str | None, dict[str, ImageInput]] = {}
        for key, image in wanted:
            if (key, image.digest) not in self.embeds:
                todo.setdefault(key, {})[image.digest] = image
        vision, model, device = self.backend.loaded.vision, self.backend.loaded.model, self.backend.device
        for key, by_digest in todo.items():
            pixels = vision.pixels(list(by_digest.values()))
            with self.backend.lora.route([(key, None)]):
                out = model.model.get_image_features(pixels["pixel_values"].to(device),
                                                     pixels["image_grid_thw"].to(device), return_dict=True)
            for n, digest in enumerate(by_digest):
                self.grid[digest] = pixels["image_grid_thw"][n]
                deep = getattr(out, "deepstack_features", None) or []  # none on Qwen3.5's tower
                self.embeds[(key, digest)] = (out.pooler_output[n], [layer[n] for layer in deep])
            self._output_type = type(out)

    def encoder_outputs(self, rows: list[tuple[str | None, tuple[ImageInput, ...]]]) -> dict:
        """``mm_encoder_outputs`` for ``rows`` (tower key, images), every row's images in row order."""
        order = [(key, image.digest) for key, row_images in rows for image in row_images]
        pooled = tuple(self.embeds[k][0] for k in order)
        layers = len(self.embeds[order[0]][1])
        deepstack = [tuple(self.embeds[k][1][layer] for k in order) for layer in range(layers)]
        fields = getattr(self._output_type, "__dataclass_fields__", {})
        extra = {"deepstack_features": deepstack} if "deepstack_features" in fields else {}
        return {"image": self._output_type(pooler_output=pooled, **extra)}


def prefill_inputs(backend, ids: torch.Tensor, mask: torch.Tensor,
                   rows: list[tuple[str | None, tuple[ImageInput, ...]]]) -> PassInputs:
    """The prefill's ``position_ids`` and ``mm_encoder_outputs`` for padded rows ``ids`` / ``mask``, row
    r holding the images ``rows[r][1]`` and routed to adapter ``rows[r][0]``."""
    model = backend.loaded.model
    features = _Features(backend)
    keyed = [(features.tower_key(key), row_images) for key, row_images in rows]
    features.compute([(key, image) for key, row_images in keyed for image in row_images])
    ordered = [image.digest for _, row_images in keyed for image in row_images]
    grid = torch.stack([features.grid[d] for d in ordered]).to(ids.device) if ordered else None
    positions, deltas = image_path.positions(model, ids, mask, grid)
    kwargs = {"position_ids": positions}
    if ordered:
        kwargs["mm_encoder_outputs"] = features.encoder_outputs(keyed)
    return PassInputs(kwargs, deltas.to(ids.device).long())
