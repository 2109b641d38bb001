"""Images in the trainer's passes: one cycle's vision-tower outputs and a pass's multimodal inputs.

A vision-language model (``LoraModel.vision``) runs a pass as ``model.model(input_ids, attention_mask,
position_ids, mm_encoder_outputs)``: the tower's outputs are computed here, not inside the model, so

- every image of a pass goes through the tower in one call (its attention is per image: the images
  do not see each other), and an image whose adapter leaves the tower alone is encoded once per
  cycle (``ImageFeatures.base``: cached by the image's digest; the base tower holds no trainable
  weight, so its output is a constant that any pass of the cycle may reuse);
- an adapter that adapts the tower (``LoraConfig.train_vision``) runs its rows' images through the
  tower on its own (the tower sees patches with no batch row to route by, so one tower call per such
  adapter, routed wholly to it), with gradients and, in a checkpointed pass, checkpointed too;
- the multimodal rotary positions of every row, text-only rows included, are computed from the rows
  themselves (``images.positions``) and passed explicitly: the model's cached ``rope_deltas`` is
  never read, so nothing leaks between rows, adapters or calls.

Imports torch only at module level (numerics' lean-import rule); the image path where pixels are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from temper.services.lora.model import LoraModel


@dataclass
class TowerOutputs:
    """What ``model.model(mm_encoder_outputs={"image": ...})`` reads: per image in placeholder order,
    its merged embeddings (N, hidden) and its deepstack features (one (N, hidden) per deepstack layer;
    none for a tower without deepstack, Qwen3.5's, whose model reads the merged embeddings only)."""

    pooler_output: tuple[torch.Tensor, ...]
    deepstack_features: list[tuple[torch.Tensor, ...]]


@dataclass
class PassImages:
    """A pass's multimodal inputs: explicit positions (3, B, T) and the images' tower outputs (None: no image)."""

    position_ids: torch.Tensor
    encoder_outputs: dict | None = None


@dataclass
class ImageFeatures:
    """One cycle's image work for a vision-language ``lora``: pixels and base-tower outputs kept per
    image digest for the cycle (the object lives for one ``numerics.forward_backward`` call).
    ``processor``: the model's ``images.VisionProcessor``."""

    lora: LoraModel
    processor: object
    pixels_of: dict = field(default_factory=dict)     # digest -> (pixel_values (P, C), grid_thw (3,))
    base: dict = field(default_factory=dict)          # digest -> (pooled (N, H), [deepstack (N, H)])
    tower_calls: int = 0                              # tower forwards run (tests and metrics read it)
    images_encoded: int = 0                           # images through those calls

    def pass_inputs(self, ids: torch.Tensor, mask: torch.Tensor, row_images: list[tuple[str, tuple]],
                    checkpointed: bool) -> PassImages:
        """``row_images``: per row of the pass, (its adapter, its ImageInputs in order)."""
        from temper.services.models.images import positions

        model = self.lora.model
        device = ids.device
        flat = [(key, image) for key, images in row_images for image in images]
        for _, image in flat:
            self._pixels(image)
        grid = torch.stack([self.pixels_of[image.digest][1] for _, image in flat]).to(device) if flat else None
        position_ids, _deltas = positions(model, ids, mask, grid)
        if not flat:
            return PassImages(position_ids)
        tuned = {key for key, _ in flat if self.lora.vision_targets(key)}
        self._encode_base([image for key, image in flat if key not in tuned], device)
        own = {key: self._encode_tuned(key, [image for k, image in flat if k == key], device, checkpointed)
               for key in tuned}
        outputs = [own[key][image.digest] if key in tuned else self.base[image.digest] for key, image in flat]
        layers = len(outputs[0][1])
        tower = TowerOutputs(tuple(pooled for pooled, _ in outputs),
                             [tuple(deep[layer] for _, deep in outputs) for layer in range(layers)])
        return PassImages(position_ids, {"image": tower})

    def _pixels(self, image) -> None:
        if image.digest not in self.pixels_of:
            made = self.processor.pixels([image])
            self.pixels_of[image.digest] = (made["pixel_values"], made["image_grid_thw"][0])

    def _encode_base(self, images: list, device) -> None:
        """The images not encoded yet this cycle, through the base tower in one call."""
        fresh = list({image.digest: image for image in images if image.digest not in self.base}.values())
        if not fresh:
            return
        with torch.no_grad(), self.lora.route([]):
            encoded = self._tower(fresh, device)
        self.base.update(encoded)

    def _encode_tuned(self, key: str, images: list, device, checkpointed: bool) -> dict:
        """``images`` (each once) through the tower with adapter ``key``'s tower LoRA, in one call: its
        outputs carry gradients to that adapter when the pass has them."""
        unique = list({image.digest: image for image in images}.values())
        if not (checkpointed and torch.is_grad_enabled()):
            with self.lora.route([(key, None)]):
                return self._tower(unique, device)
        digests = [image.digest for image in unique]
        pixel_values, grid = self._stacked(unique, device)

        def run(pixel_values, grid):
            # routed inside: the recomputation in the backward pass may run on another thread
            with self.lora.route([(key, None)]):
                pooled, deep = self._run_tower(pixel_values, grid)
            return (pooled, *deep)

        pooled, *deep = checkpoint(run, pixel_values, grid, use_reentrant=False)
        self._count(len(unique))
        return self._split(digests, grid, pooled, deep)

    def _tower(self, images: list, device) -> dict:
        pixel_values, grid = self._stacked(images, device)
        pooled, deep = self._run_tower(pixel_values, grid)
        self._count(len(images))
        return self._split([image.digest for image in images], grid, pooled, deep)

    def _stacked(self, images: list, device) -> tuple[torch.Tensor, torch.Tensor]:
        visual = self.lora.model.model.visual
        pixel_values = torch.cat([self.pixels_of[image.digest][0] for image in images]).to(device, visual.dtype)
        grid = torch.stack([self.pixels_of[image.digest][1] for image in images]).to(device)
        return pixel_values, grid

    def _run_tower(self, pixel_values: torch.Tensor, grid: torch.Tensor):
        out = self.lora.model.model.visual(pixel_values, grid_thw=grid, return_dict=True)
        # Qwen3.5's tower has no deepstack features: an empty list of layers
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])

    def _split(self, digests: list[str], grid: torch.Tensor, pooled: torch.Tensor, deep: list) -> dict:
        merge = self.lora.model.model.visual.spatial_merge_size ** 2
        sizes = (grid.prod(-1) // merge).tolist()
        pieces = pooled.split(sizes)
        deep_pieces = [d.split(sizes) for d in deep]
        return {digest: (pieces[i], [d[i] for d in deep_pieces]) for i, digest in enumerate(digests)}

    def _count(self, images: int) -> None:
        self.tower_calls += 1
        self.images_encoded += images


def pass_images(features: "ImageFeatures | None", ids, mask, rows: list[tuple], checkpointed: bool):
    """A training pass's image inputs: ``rows`` is (adapter, images) per row; None for a text-only model,
    which refuses rows with images."""
    if features is not None:
        return features.pass_inputs(ids, mask, rows, checkpointed)
    if any(images for _, images in rows):
        raise ValueError("rows with images need the model's vision processor (numerics.forward_backward's vision)")
    return None

