"""Batch-invariant compute: a token's numbers do not depend on the other rows of its pass, on padding,
or on whether its keys come from a KV cache (``docs/deterministic.md``).

Inside ``deterministic(model)``:
- every LoRA-wrapped linear (base weight and adapter factors) is ``linear``: rows padded to at least
  ``MIN_ROWS`` (MKL takes another, differently-reducing path for 1-3 rows: measured, every M from 4
  to 299 gives row i the same bits on one thread, for the SmolLM2 shapes, mm and bmm; 8 leaves a
  margin) and computed with one intra-op thread (with more, MKL splits the reduction differently for
  different row counts); ``deterministic_lora`` adds the adapters;
- attention is ``attention`` (registered with transformers as ``ATTENTION``): keys reduced in blocks
  of ``KEY_BLOCK`` aligned on their positions, fully masked blocks add exact zeros, blocks summed left
  to right, so a query sees the same additions whether its keys come from a cache of t+1 keys or a
  causally masked row of T; the mask is derived from ``position_ids`` (a key at slot j is seen by a
  query at position p iff j <= p), so keys must sit at their positions (``DecodeCache``);
- ``target_logprobs`` is the one log p(target) = logit - logsumexp both trainer and sampler use.

Families: dense llama and qwen3/qwen2 (``unsupported`` names what refuses the others, the
vision-language families by name).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

MIN_ROWS = 8  # raised by ``_calibrate`` where this machine needs more (row_invariance.py)
KEY_BLOCK = 64
ATTENTION = "temper_deterministic"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen3", "qwen2")

_state = threading.local()
_calibrated: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()  # _calibrate's answers


def active() -> bool:
    return getattr(_state, "on", False)


def unsupported(model) -> str:
    """Why ``model`` cannot compute deterministically; "" when it can."""
    config = getattr(model.config, "text_config", None) or model.config
    model_type = getattr(config, "model_type", None)
    if getattr(model.config, "vision_config", None) is not None:
        from temper.services.models.families import UnknownFamily, family_of
        try:
            family = family_of(model.config).name
        except UnknownFamily:
            family = getattr(model.config, "model_type", model_type)
        return (f"deterministic mode does not cover the vision-language family {family}: its vision tower, deepstack "
                f"merges and multimodal positions have no batch-invariant kernels here")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"deterministic mode covers the dense families {list(SUPPORTED_MODEL_TYPES)}; {model_type!r} "
                f"(mixture-of-experts routing, MLA or attention sinks) has no batch-invariant kernels here")
    if getattr(config, "use_sliding_window", False) or getattr(config, "layer_types", None) and any(
            t != "full_attention" for t in config.layer_types):
        return f"deterministic mode has no sliding-window attention ({model_type} with sliding-window layers)"
    if getattr(config, "final_logit_softcapping", None):
        return "deterministic mode has no logit soft-capping"
    return _calibrate(model)


def _calibrate(model) -> str:
    """Raise ``MIN_ROWS`` to the row count from which this machine's matmuls for ``model`` are
    row-invariant (``row_invariance.py``); why deterministic mode is off when none is. Once per model:
    asked again for every deterministic item and GetModelInfo."""
    if model not in _calibrated:
        _calibrated[model] = _check_row_invariance(model)
    return _calibrated[model]


def _check_row_invariance(model) -> str:
    global MIN_ROWS
    from temper.services.lora.row_invariance import FLOORS, row_floor, stacking_agrees

    floor = row_floor(model, KEY_BLOCK)
    if floor is None:
        return (f"this machine's matmuls for the model's shapes give a row different bits depending on the rows "
                f"beside it, with up to {FLOORS[-1]} rows (checked at start-up): no batch-invariant kernels here")
    MIN_ROWS = max(MIN_ROWS, floor)  # a floor that works keeps working above it
    from temper.services.lora import deterministic_lora

    if not stacking_agrees(model, MIN_ROWS):  # decode then runs the adapters one by one, as the trainer does
        deterministic_lora.STACKING = False
    return ""


@contextlib.contextmanager
def deterministic(model, cache: "DecodeCache | None" = None):
    """Run ``model``'s forward (and backward) passes with the batch-invariant primitives."""
    _register()
    config = model.config
    previous = (_enter(cache), config._attn_implementation, torch.get_num_threads())
    config._attn_implementation = ATTENTION
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _leave(previous[0])
        config._attn_implementation = previous[1]
        torch.set_num_threads(previous[2])


@contextlib.contextmanager
def on_this_thread(cache: "DecodeCache | None" = None):
    """This thread computes with the batch-invariant primitives, inside a ``deterministic(model)``
    scope another thread holds open (the model's attention switch and the process's thread count are
    that scope's): a worker running passes side by side with another one.

    ``torch.set_num_threads`` is only partly process-wide: OpenMP's thread count is each thread's own
    (a fresh thread starts with the process default) while MKL's and ATen's are the process's. So
    the worker sets one thread itself, after ATen's per-thread first-use initialisation (which
    re-applies the process's count), and leaves it at one: never restoring a count while another
    worker may be inside a matmul (the outer scope restores the process's at its end). Meant for
    threads that run deterministic passes only."""
    torch.get_num_threads()  # ATen's lazy per-thread initialisation, now rather than mid-pass
    torch.set_num_threads(1)
    previous = _enter(cache)
    try:
        yield
    finally:
        _leave(previous)


def _enter(cache: "DecodeCache | None") -> tuple:
    previous = (getattr(_state, "on", False), getattr(_state, "cache", None), getattr(_state, "memo", None))
    _state.on, _state.cache, _state.memo = True, cache, {}
    return previous


def _leave(previous: tuple) -> None:
    _state.on, _state.cache, _state.memo = previous


def memo() -> dict:
    """A dict that lives as long as this thread's innermost deterministic scope: for what is fixed
    inside one (weights do not change during a pass or a decode), such as stacked adapter factors."""
    return _state.memo


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def worker_pool(workers: int) -> ThreadPoolExecutor:
    """Threads for deterministic work only (trainer passes, decode parts), each inside
    ``on_this_thread`` while it computes, so they stay on one intra-op thread."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="deterministic")
        return _POOLS[workers]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every row is the same whatever the other rows (one thread, >= MIN_ROWS rows)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows < MIN_ROWS:
        flat = F.pad(flat, (0, 0, 0, MIN_ROWS - rows))
    out = F.linear(flat, weight, bias)[:rows]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, V) float32 logits, (N, K) targets -> log p: the formula of the trainer's target_logprobs."""
    return logits.gather(-1, targets) - torch.logsumexp(logits, dim=-1, keepdim=True)


class DecodeCache:
    """Keys and values of a decode, each row's at the slot of its position (not left-padded), so its
    blocks line up with a full forward's. ``capacity``: slots per row (a multiple of KEY_BLOCK)."""

    def __init__(self, rows: int, capacity: int):
        self.rows = rows
        self.capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sharing: torch.Tensor | None = None  # inside ``prefill``: the rows the pass's one row fills

    @contextlib.contextmanager
    def prefill(self, rows: torch.Tensor):
        """The passes inside (one prompt, one row, positions from 0) fill the cache ``rows``: the
        samples of a prompt share its prefill (a row's numbers do not depend on the pass's others)."""
        self.sharing = rows
        try:
            yield
        finally:
            self.sharing = None

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor):
        """Write (B, H, M, d) keys/values at ``positions`` (B, M); returns the slots up to the last
        position, rounded up to whole KEY_BLOCKs (in ``prefill``: the pass's own keys, which
        attention pads with zeros to whole blocks, as the cache's unused slots are)."""
        if layer not in self.layers:
            shape = (self.rows, key.shape[1], self.capacity, key.shape[-1])
            self.layers[layer] = (key.new_zeros(shape), value.new_zeros(shape[:-1] + (value.shape[-1],)))
        keys, values = self.layers[layer]
        if self.sharing is not None:
            keys[self.sharing, :, :key.shape[2]] = key
            values[self.sharing, :, :value.shape[2]] = value
            return key, value
        index = positions[:, None, :, None]
        keys.scatter_(2, index.expand_as(key), key)
        values.scatter_(2, index.expand_as(value), value)
        # whole KEY_BLOCKs (slots past the last position hold zeros or keys no query sees: masked to weight 0,
        # as a causal row's later keys are), so attention pads nothing: no copy of the cache per layer and step
        used = -(-(int(positions.max()) + 1) // KEY_BLOCK) * KEY_BLOCK
        return keys[:, :, :used], values[:, :, :used]


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              position_ids: torch.Tensor | None = None, **kwargs):
    """Causal attention by position, keys reduced in aligned blocks; returns (B, M, H, d), None.

    The query heads sharing a key/value head are stacked as rows of one matmul against that head's
    keys (no copy of the keys per query head): row-invariant matmuls of >= MIN_ROWS rows make a
    query's numbers the same whatever the other rows, as for ``linear``."""
    if dropout:
        raise RuntimeError("deterministic attention has no dropout")
    batch, heads, rows, dim = query.shape
    if position_ids is None:
        position_ids = torch.arange(rows, device=query.device)[None].expand(batch, rows)
    position_ids = position_ids.expand(batch, rows)
    cache = getattr(_state, "cache", None)
    if cache is not None:
        key, value = cache.update(module.layer_idx, key, value, position_ids)
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    keys = key.shape[2]
    padded = -(-keys // KEY_BLOCK) * KEY_BLOCK
    if padded != keys:
        key = torch.cat([key, key.new_zeros(batch, kv_heads, padded - keys, dim)], 2)
        value = torch.cat([value, value.new_zeros(batch, kv_heads, padded - keys, value.shape[-1])], 2)
    query = query.reshape(batch, kv_heads, groups * rows, dim)                      # row g * M + m: head kv*groups + g
    positions = position_ids.repeat(1, groups)                                       # (B, groups * M)
    stacked = groups * rows
    if stacked < MIN_ROWS:  # matmuls of fewer rows reduce differently
        query = torch.cat([query, query.new_zeros(batch, kv_heads, MIN_ROWS - stacked, dim)], 2)
        positions = torch.cat([positions, positions[:, -1:].expand(batch, MIN_ROWS - stacked)], 1)
    scale = dim ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale                     # (B, Hkv, M', Np)
    seen = torch.arange(padded, device=query.device)[None, None, None, :] <= positions[:, None, :, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()                        # masked: exactly 0
    blocks = padded // KEY_BLOCK
    tiles = weights.unflatten(-1, (blocks, KEY_BLOCK))                               # (B, Hkv, M', nb, 64)
    denominator = tiles.sum(-1).cumsum(-1)[..., -1:]                                 # blocks left to right
    partial = torch.matmul(tiles.transpose(2, 3), value.unflatten(2, (blocks, KEY_BLOCK)))  # (B, Hkv, nb, M', d)
    numerator = partial.cumsum(2)[:, :, -1]                                          # (B, Hkv, M', d)
    out = (numerator / denominator)[:, :, :stacked].unflatten(2, (groups, rows))     # (B, Hkv, groups, M, d)
    return out.reshape(batch, heads, rows, -1).transpose(1, 2).contiguous(), None


def _register() -> None:
    if getattr(_register, "done", False):
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
    _register.done = True

