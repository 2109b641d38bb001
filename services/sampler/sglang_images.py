"""What the SGLang backend serves of image prompts, as read in the pinned sglang 0.5.23 wheel
(``python/sglang/``); everything else is refused by name (FAILED_PRECONDITION), never answered wrong.

Served: sampling with images, with or without a LoRA adapter on the language model.
- ``srt/models/qwen3_vl.py::Qwen3VLForConditionalGeneration.should_apply_lora`` (and
  ``qwen3_vl_moe.py``'s) admits ``model.layers.N.(self_attn|mlp).*`` (and lm_head / embed_tokens):
  ``srt/lora/lora_manager.py`` wraps the language model's linears of a vision-language model, and a
  request's ``lora_path`` applies to its image prompt's decoder pass like any other.
- ``Engine.generate`` / ``GenerateReqInput`` take ``image_data`` per item next to ``input_ids``; for
  qwen3_vl / qwen3_vl_moe ``srt/multimodal/processors/qwen_vl.py::process_mm_data_async`` composes
  them by ``BaseMultimodalProcessor.build_input_ids``, which expands each image token (a position
  whose next token is the image token) into the image's N tokens without re-tokenizing the text:
  Temper sends each image as one image token (``sglang_requests.collapsed_ids``).

Refused:
- Prompt logprobs (``compute_logprobs``, ``include_prompt_logprobs``, top-k prompt logprobs) over a
  range that holds an image token: SGLang scores a prompt position against ``req.origin_input_ids``,
  which for a multimodal request hold the radix cache's per-image pad values (hashes of the image)
  in place of the image tokens, clamped into the vocabulary
  (``srt/managers/schedule_batch.py::ScheduleBatch.prepare_for_extend``, "Clamp placeholder or
  out-of-range token IDs (e.g., multimodal hashes)"; ``scheduler_components/logprob_result_processor.py``),
  so those positions are not log p(image token). Ranges after the last image (``prompt_logprobs_last_n``)
  are text and are served.
- LoRA on the vision tower or merger (``model.visual.*``): ``should_apply_lora`` above skips those modules
  and ``srt/lora/lora.py`` files weights by ``layers.N``, so their tensors would be dropped silently
  (``sglang_adapters.check_servable``).
- Deterministic requests, as for text (``sglang_backend.DETERMINISTIC_UNSUPPORTED``).
"""

from __future__ import annotations

import numpy as np

from temper.common.errors import FailedPrecondition
from temper.services.sampler.sglang_adapters import SGLANG_VERSION

SCORING_REFUSAL = (
    f"SGLang {SGLANG_VERSION} cannot score prompt positions that hold image tokens: it scores them against the radix "
    f"cache's per-image pad values clamped into the vocabulary (srt/managers/schedule_batch.py, "
    f"ScheduleBatch.prepare_for_extend), not the image token; score only the text after the last image "
    f"(prompt_logprobs_last_n), or use a torch-backend sampler")


def check_scoring(prompt: np.ndarray, images, first_scored: int | None) -> None:
    """FailedPrecondition when prompt positions from ``first_scored`` on (None: none scored) hold an image token."""
    if first_scored is None or not images:
        return
    last_image_token = max(i.offset + i.tokens for i in images) - 1
    if max(first_scored, 1) <= last_image_token:
        raise FailedPrecondition(f"prompt logprobs with images: {SCORING_REFUSAL}")
