"""The torch sampler's per-prompt prefill for text models: each request's prompt runs once, alone
(one row, no padding), for all of its samples, and through the prefix cache when the request names a
sampling session: the cached KV of its longest cached prefix is reused and only the rest is
prefilled. The rows' KV are then laid out as the decode loop's left-padded batch cache.

Why per prompt: a group of N samples of one prompt prefilled as N padded rows computes the same KV N
times; once, then broadcast to its N rows, is the same numbers (attention never reads across rows,
and padding is masked), and it is what the prefix cache stores.

Models whose cache is not one plain (keys, values) pair per layer and position (sliding windows,
linear attention state, vision models' multimodal positions) keep the batched prefill (the backend
asks ``supports_prompt_prefill`` once)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from temper.services.sampler.backend import SampleRequest
from temper.services.sampler.prefix_cache import CacheScope, PrefixCache, PrefixKV


@dataclass
class PrefilledPrompt:
    kv: PrefixKV                       # per layer (1, heads, len(prompt), head_dim)
    last_logits: torch.Tensor          # (vocab,) float32: the next token's distribution
    prompt_logits: torch.Tensor | None  # (len(prompt), vocab): when the request scores its prompt
    hit_tokens: int                    # leading prompt tokens whose KV came from the cache


def supports_prompt_prefill(model, lora, device: torch.device) -> bool:
    """Whether ``model`` keeps a plain per-position KV cache (one DynamicLayer per layer), probed with
    a one-token forward: only then can a prefix's KV be sliced, reused and padded."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.no_grad(), lora.route([(None, None)]):
        past = model(input_ids=ids, use_cache=True).past_key_values
    return isinstance(past, DynamicCache) and all(type(layer) is DynamicLayer for layer in past.layers)


def _keeps_logits(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def scores_prompt(request: SampleRequest) -> bool:
    return bool(request.prompt_logprobs or request.topk_prompt_logprobs)


@torch.no_grad()
def prefill(model, lora, device: torch.device, request: SampleRequest, cache: PrefixCache,
            scope: CacheScope | None) -> PrefilledPrompt:
    """One request's prompt KV and logits. With a ``scope`` (and the cache on) the longest cached
    prefix is reused, at most len(prompt) - 1 tokens (the last position's logits must be computed),
    and the whole prompt's KV is stored for later requests. A request that scores its prompt needs
    every position's logits, so it does not reuse a prefix (it still stores its KV)."""
    prompt = request.prompt.astype(np.int64)
    n = len(prompt)
    hit = (cache.lookup(scope, prompt, n - 1)
           if scope is not None and cache.enabled and not scores_prompt(request) else None)
    start = hit.tokens if hit is not None else 0
    past = DynamicCache()
    if hit is not None:
        for layer, (k, v) in enumerate(hit.kv):
            past.update(k, v, layer)  # concatenated into new tensors by the layer: the cached ones stay untouched
    ids = torch.from_numpy(prompt[start:]).to(device)[None]
    kwargs = {}
    if not scores_prompt(request) and _keeps_logits(model):
        kwargs["logits_to_keep"] = 1  # only the last position's logits: the prompt is not scored
    with lora.route([(request.checkpoint_key, None)]):
        out = model(input_ids=ids, position_ids=torch.arange(start, n, device=device)[None],
                    past_key_values=past, use_cache=True, **kwargs)
    kv = tuple((layer.keys, layer.values) for layer in out.past_key_values.layers)
    if scope is not None and cache.enabled:
        cache.store(scope, prompt, tuple((k.clone(), v.clone()) for k, v in kv))
    return PrefilledPrompt(kv, out.logits[0, -1].float(), out.logits[0] if scores_prompt(request) else None, start)


def batch_cache(prompts: list[PrefilledPrompt], rows: list[list[int]], width: int) -> DynamicCache:
    """The decode loop's cache: row r of prompt i holds its KV right-aligned in ``width`` positions
    (left padding, as the batched prefill lays it out; the padding is zeros and masked out)."""
    total = sum(len(r) for r in rows)
    layers = []
    for layer in range(len(prompts[0].kv)):
        k0, v0 = prompts[0].kv[layer]
        keys = k0.new_zeros(total, k0.shape[1], width, k0.shape[3])
        values = v0.new_zeros(total, v0.shape[1], width, v0.shape[3])
        for prompt, prompt_rows in zip(prompts, rows):
            k, v = prompt.kv[layer]
            index = torch.tensor(prompt_rows, device=k.device)
            keys[index, :, width - k.shape[2]:] = k
            values[index, :, width - v.shape[2]:] = v
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)
