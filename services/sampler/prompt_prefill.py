"""The torch sampler's prefill for text models: each distinct prompt of a batch runs once, however
many samples or requests share it, through the prefix cache when its request names a sampling
session, and the rows' KV are laid out as the decode loop's left-padded batch cache.

Per distinct prompt (same adapter, same cache scope, same tokens):
- a full hit (the same prompt again in the session) reuses the stored KV and last-position logits:
  the request decodes bit for bit as the one that stored them;
- a partial hit (a cached prefix) prefills only the rest, alone, over the cached KV;
- misses are prefilled together, in one left-padded forward (as the batched prefill does), and
  each row's KV is sliced out for the cache. A prompt prefilled alone and the same prompt prefilled
  in a padded batch may differ in the last float32 bits; a full hit returns whichever the cache
  holds, the KV and logits of one computation, never a mix.

Why once per distinct prompt: a group of N samples of one prompt prefilled as N padded rows computes
the same KV N times; once, then broadcast to its N rows, is the same numbers (attention never reads
across rows, and padding is masked).

Models whose cache is not one plain (keys, values) pair per layer and position (sliding windows,
linear attention state, vision models' multimodal positions) keep the backend's batched prefill of
every row (the backend asks ``supports_prompt_prefill`` once)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

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


@dataclass
class Prefill:
    prompts: list[PrefilledPrompt]   # one per request (requests that share a prompt share the object)
    past: DynamicCache | None = None  # the one batched forward's cache, when it is already the decode's layout ...
    logits: torch.Tensor | None = None  # ... and its last positions' logits, one row per request


@dataclass
class _Distinct:
    key: str | None
    tokens: np.ndarray
    scope: CacheScope | None
    scores: bool
    done: PrefilledPrompt | None = None
    requests: list[int] = field(default_factory=list)


def supports_prompt_prefill(model, lora, device: torch.device) -> bool:
    """Whether ``model`` keeps a plain per-position KV cache (one DynamicLayer per layer), probed with
    a one-token forward: only then can a prefix's KV be sliced, reused and padded."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.no_grad(), lora.route([(None, None)]):
        past = model(input_ids=ids, use_cache=True).past_key_values
    return isinstance(past, DynamicCache) and all(type(layer) is DynamicLayer for layer in past.layers)


def _keeps_logits(model) -> bool:
    return _forward_keeps_logits(type(model).forward)


@functools.cache  # inspect.signature costs tens of microseconds: once per model class, not per batch
def _forward_keeps_logits(forward) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def scores_prompt(request: SampleRequest) -> bool:
    return bool(request.prompt_logprobs or request.topk_prompt_logprobs)


@torch.no_grad()
def prefill(model, lora, device: torch.device, requests: list[SampleRequest], scopes: list[CacheScope | None],
            cache: PrefixCache, together: bool = True) -> Prefill:
    """Every request's prompt KV and logits. A request with a scope (and the cache on) reuses its
    session's cached prompt or prefix and stores its whole prompt's KV and last logits for later
    requests. A request that scores its prompt needs every position's logits, so it reuses nothing
    (it still stores). ``together=False`` prefills each missed prompt alone (the benchmark's control)."""
    distinct: dict[tuple, _Distinct] = {}
    for i, (r, scope) in enumerate(zip(requests, scopes)):
        scope, scores, tokens = scope if cache.enabled else None, scores_prompt(r), r.prompt.astype(np.int64)
        name = (r.checkpoint_key, scope, scores, tokens.tobytes())
        if name not in distinct:
            distinct[name] = _Distinct(r.checkpoint_key, tokens, scope, scores)
        distinct[name].requests.append(i)
    missed = []
    for d in distinct.values():
        hit = (cache.lookup(d.scope, d.tokens, len(d.tokens) - 1, whole=True)
               if d.scope is not None and not d.scores else None)
        if hit is None:
            missed.append(d)
        elif hit.logits is not None:  # the same prompt again: its stored KV and logits, nothing computed
            d.done = PrefilledPrompt(hit.kv, hit.logits, None, hit.tokens)
        else:
            d.done = _extend(model, lora, device, d, hit.tokens, hit.kv)
            cache.store(d.scope, d.tokens, d.done.kv, d.done.last_logits)  # new tensors (the suffix concatenated), read-only from here
    past = logits = None
    for scoring in (False, True):  # the scored prompts apart: only they need every position's logits
        group = [d for d in missed if d.scores == scoring]
        for chunk in ([group] if together else [[d] for d in group]):
            if not chunk:
                continue
            out = _prefill_missed(model, lora, device, chunk, cache)
            if len(chunk) == len(distinct) == len(requests) and all(r.num_samples == 1 for r in requests):
                # every request one row, in order: the forward's cache and logits are the decode's as they are
                past, logits = out.past_key_values, out.logits[:, -1].float()
            else:
                _slice_rows(out.past_key_values, chunk)
    prompts = [None] * len(requests)
    for d in distinct.values():
        for i in d.requests:
            prompts[i] = d.done
    return Prefill(prompts, past, logits)


def _extend(model, lora, device, d: _Distinct, start: int, kv: PrefixKV) -> PrefilledPrompt:
    """A partial hit: positions [start, n) prefilled alone over the cached KV of [0, start)."""
    past = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        past.update(k, v, layer)  # concatenated into new tensors by the layer: the cached ones stay untouched
    n = len(d.tokens)
    ids = torch.from_numpy(d.tokens[start:]).to(device)[None]
    with lora.route([(d.key, None)]):
        out = model(input_ids=ids, position_ids=torch.arange(start, n, device=device)[None], past_key_values=past,
                    use_cache=True, **({"logits_to_keep": 1} if _keeps_logits(model) else {}))
    kv = tuple((layer.keys, layer.values) for layer in out.past_key_values.layers)
    return PrefilledPrompt(kv, out.logits[0, -1].float().clone(), None, start)  # its own tensor: the cache keeps it


def _prefill_missed(model, lora, device, chunk: list[_Distinct], cache: PrefixCache):
    """The missed prompts of ``chunk`` in one left-padded forward (each prompt one row); each row's KV
    is copied into the cache when the prompt has a scope. Returns the forward's output; the rows' KV
    views are cut only when the decode needs them (``_slice_rows``)."""
    width = max(len(d.tokens) for d in chunk)
    lengths = np.array([len(d.tokens) for d in chunk])
    ids = np.zeros((len(chunk), width), dtype=np.int64)
    for row, d in enumerate(chunk):
        ids[row, width - len(d.tokens):] = d.tokens
    mask = torch.from_numpy(np.arange(width)[None] >= (width - lengths)[:, None]).to(device=device, dtype=torch.long)
    ids = torch.from_numpy(ids).to(device)
    groups: dict[str | None, list[int]] = {}
    for row, d in enumerate(chunk):
        groups.setdefault(d.key, []).append(row)
    scores = chunk[0].scores
    keep = {} if scores or not _keeps_logits(model) else {"logits_to_keep": 1}
    with lora.route([(key, torch.tensor(rows, device=device)) for key, rows in groups.items() if key is not None]):
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True, **keep)
    last = out.logits[:, -1].float()
    for row, (d, row_logits) in enumerate(zip(chunk, last.unbind(0))):
        n = len(d.tokens)
        d.done = PrefilledPrompt((), row_logits, out.logits[row, width - n:] if scores else None, 0)
        if d.scope is not None:
            cache.store(d.scope, d.tokens, _row_kv(out.past_key_values, row, width, n, copy=True), row_logits.clone())
    return out


def _row_kv(past: DynamicCache, row: int, width: int, n: int, copy: bool = False) -> PrefixKV:
    """Row ``row``'s KV of its last ``n`` positions (views of the batch's tensors, or copies that own their memory)."""
    views = tuple((layer.keys[row:row + 1, :, width - n:], layer.values[row:row + 1, :, width - n:]) for layer in past.layers)
    return tuple((k.clone(), v.clone()) for k, v in views) if copy else views


def _slice_rows(past: DynamicCache, chunk: list[_Distinct]) -> None:
    width = past.layers[0].keys.shape[-2]
    for row, d in enumerate(chunk):
        d.done.kv = _row_kv(past, row, width, len(d.tokens))


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
