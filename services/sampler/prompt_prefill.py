"""The torch sampler's prefill for text models: each distinct prompt of a batch runs once, however
many samples or requests share it, through the prefix cache when its request names a sampling
session, and the rows' KV are laid out as the decode loop's left-padded batch cache.

Per distinct prompt (same adapter, same cache scope, same tokens):
- a full hit (the same prompt again in the session) reuses the stored KV and last-position logits:
  the request decodes bit for bit as the one that stored them;
- a partial hit (a cached prefix: a shared system prompt, the last turn) prefills only the rest
  over the cached KV;
- a miss prefills the whole prompt.
The partial hits and misses of a batch run in one forward (the scored prompts in a second: only they
need every position's logits): the cached prefixes are its past, right-aligned, and every row's rest
is left-padded after them, pads masked (``_prefill_rows``); without prefixes that is the plain
left-padded batched prefill. Each row's KV is cut out for the cache. A prompt prefilled alone and
the same prompt prefilled in a padded batch may differ in the last float32 bits; a full hit returns
whichever the cache holds, the KV and logits of one computation, never a mix.

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
    start: int = 0               # a partial hit: the cached leading tokens ...
    prefix: PrefixKV = ()        # ... and their KV (views of the cache's tensors)


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
    pending = []
    for d in distinct.values():
        hit = (cache.lookup(d.scope, d.tokens, len(d.tokens) - 1, whole=True)
               if d.scope is not None and not d.scores else None)
        if hit is not None and hit.logits is not None:  # the same prompt again: its stored KV and logits, nothing computed
            d.done = PrefilledPrompt(hit.kv, hit.logits, None, hit.tokens)
            continue
        if hit is not None:  # a cached prefix: only the rest is prefilled, over it
            d.start, d.prefix = hit.tokens, hit.kv
        pending.append(d)
    past = logits = None
    for scoring in (False, True):  # the scored prompts apart: only they need every position's logits
        group = [d for d in pending if d.scores == scoring]
        for chunk in ([group] if together else [[d] for d in group]):
            if not chunk:
                continue
            out = _prefill_rows(model, lora, device, chunk, cache)
            if (len(chunk) == len(distinct) == len(requests) and not any(d.start for d in chunk)
                    and all(r.num_samples == 1 for r in requests)):
                # every request one row, in order, no cached prefix: the forward's cache and logits are the decode's
                past, logits = out.past_key_values, out.logits[:, -1].float()
                continue
            total = out.past_key_values.layers[0].keys.shape[-2]
            for row, d in enumerate(chunk):
                if not d.start:  # a miss: its tokens are the row's last positions (views)
                    d.done.kv = _row_kv(out.past_key_values, row, total, len(d.tokens))
    prompts = [None] * len(requests)
    for d in distinct.values():
        for i in d.requests:
            prompts[i] = d.done
    return Prefill(prompts, past, logits)


def _prefill_rows(model, lora, device, chunk: list[_Distinct], cache: PrefixCache):
    """The prompts of ``chunk`` in one forward, one row each. A partial hit's cached prefix is the
    forward's past, right-aligned in P positions (zeros before it); every row's remaining tokens are
    left-padded in the S positions after those: [pad][prefix][pad][rest] per row, the pads masked and
    the position ids counting each row's own tokens. Without prefixes (P = 0) this is the plain
    left-padded batched prefill. Each row's KV is copied into the cache when the prompt has a scope;
    a partial hit's KV is cut out here, the gap left out (a miss's are views, cut by the caller)."""
    starts = np.array([d.start for d in chunk])
    rests = np.array([len(d.tokens) for d in chunk]) - starts
    prefix_width, width = int(starts.max()), int(rests.max())
    ids = np.zeros((len(chunk), width), dtype=np.int64)
    for row, d in enumerate(chunk):
        ids[row, width - rests[row]:] = d.tokens[d.start:]
    first = (width - rests)[:, None]  # each row's first real column
    rest_mask = np.arange(width)[None] >= first
    positions = np.where(rest_mask, starts[:, None] + np.arange(width)[None] - first, 0)
    mask = np.concatenate([np.arange(prefix_width)[None] >= (prefix_width - starts)[:, None], rest_mask], axis=1)
    past = padded_past([d.prefix for d in chunk], [[r] for r in range(len(chunk))], prefix_width) if prefix_width else None
    groups: dict[str | None, list[int]] = {}
    for row, d in enumerate(chunk):
        groups.setdefault(d.key, []).append(row)
    scores = chunk[0].scores
    keep = {} if scores or not _keeps_logits(model) else {"logits_to_keep": 1}
    with lora.route([(key, torch.tensor(rows, device=device)) for key, rows in groups.items() if key is not None]):
        out = model(input_ids=torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device, torch.long),
                    position_ids=torch.from_numpy(positions).to(device), past_key_values=past, use_cache=True, **keep)
    last = out.logits[:, -1].float()
    for row, (d, row_logits) in enumerate(zip(chunk, last.unbind(0))):
        n = len(d.tokens)
        kv = ()
        if d.start:  # the prefix's positions and the rest's, the gap between them left out (new tensors)
            layers = out.past_key_values.layers
            cut = (slice(prefix_width - d.start, prefix_width), slice(prefix_width + width - rests[row], None))
            kv = tuple((torch.cat([l.keys[row:row + 1, :, c] for c in cut], -2),
                        torch.cat([l.values[row:row + 1, :, c] for c in cut], -2)) for l in layers)
        d.done = PrefilledPrompt(kv, row_logits, out.logits[row, width - n:] if scores else None, d.start)
        if d.scope is not None:
            kv = kv or _row_kv(out.past_key_values, row, prefix_width + width, n, copy=True)
            cache.store(d.scope, d.tokens, kv, row_logits.clone())
    return out


def _row_kv(past: DynamicCache, row: int, width: int, n: int, copy: bool = False) -> PrefixKV:
    """Row ``row``'s KV of its last ``n`` positions (views of the batch's tensors, or copies that own their memory)."""
    views = tuple((layer.keys[row:row + 1, :, width - n:], layer.values[row:row + 1, :, width - n:]) for layer in past.layers)
    return tuple((k.clone(), v.clone()) for k, v in views) if copy else views


def padded_past(kvs: list[PrefixKV], rows: list[list[int]], width: int) -> DynamicCache:
    """KV laid out as a left-padded batch: ``kvs[i]`` (one row's; empty: none) right-aligned in ``width``
    positions of each row of ``rows[i]``, zeros before (the padding, masked out). The decode loop's cache
    (a prompt's KV in each of its samples' rows) and a prefill's past of cached prefixes alike."""
    some = next(kv for kv in kvs if kv)
    total = sum(len(r) for r in rows)
    layers = []
    for layer, (k0, v0) in enumerate(some):
        keys = k0.new_zeros(total, k0.shape[1], width, k0.shape[3])
        values = v0.new_zeros(total, v0.shape[1], width, v0.shape[3])
        for kv, kv_rows in zip(kvs, rows):
            if kv:
                k, v = kv[layer]
                index = torch.tensor(kv_rows, device=k.device)
                keys[index, :, width - k.shape[2]:] = k
                values[index, :, width - v.shape[2]:] = v
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)
