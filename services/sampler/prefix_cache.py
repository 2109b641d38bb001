"""A prompt-prefix KV cache for the torch sampler: the keys and values a prompt's prefill computed,
kept so a later request of the same sampling session, on the same adapter, that starts with the same
tokens prefills only the rest (RL samples one prompt in many requests; multi-turn prompts extend the
previous turn's).

Isolation: an entry belongs to one ``CacheScope`` (tenant, sampling session, checkpoint key and the
adapter's load generation), and a lookup only reads entries of its own scope, so nothing is shared
across tenants, sessions, adapters or versions of one adapter (a reload under the same key bumps its
generation; ``drop_adapter`` also frees the old entries at once).

Matching is at token granularity: the KV at position i depends only on tokens[:i + 1] (causal
attention), so any entry's first m positions serve a prompt that shares its first m tokens. Blocks
would waste up to a block per hit on short RL prompts and buy nothing here: a scope holds a handful of
entries, compared with one vectorised comparison each. Entries that are a prefix of a newer entry
are dropped (the newer one serves them), so multi-turn sessions keep one growing entry.

Memory is bounded by ``budget_bytes`` (the tensors' bytes); the least recently used entries, of any
scope, are evicted first. An entry larger than the whole budget is not stored. Budget 0 disables.

KV is model-agnostic here: a tuple of per-layer (keys, values) tensors whose position axis is -2
(transformers' (batch, heads, positions, head_dim)); the cache never looks inside them. Prompts with
images are not cached (the backend does not ask): their positions are multimodal and their tokens
alone do not name the image."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import numpy as np
import torch

from temper.services.sampler import metrics

LayerKV = tuple[torch.Tensor, torch.Tensor]
PrefixKV = tuple[LayerKV, ...]


@dataclass(frozen=True)
class CacheScope:
    """Who may read an entry: the same tenant, sampling session and adapter version, nothing broader."""

    tenant: str
    session: str
    checkpoint_key: str | None   # None: the base model
    adapter_generation: int = 0  # bumped by the backend each time it (re)loads the key


@dataclass
class PrefixHit:
    tokens: int   # how many leading prompt tokens the KV covers
    kv: PrefixKV  # views of the entry's tensors, positions [0, tokens); read-only by contract


@dataclass
class _Entry:
    scope: CacheScope
    tokens: np.ndarray
    kv: PrefixKV
    nbytes: int


def kv_bytes(kv: PrefixKV) -> int:
    return sum(t.numel() * t.element_size() for layer in kv for t in layer)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """Thread-safe: the servicer may sample from several threads."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_scope: dict[CacheScope, set[int]] = {}
        self._ids = count()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, scope: CacheScope, tokens: np.ndarray, max_tokens: int) -> PrefixHit | None:
        """The longest cached prefix of ``tokens`` in ``scope``, at most ``max_tokens`` long (the caller
        keeps at least the last token to prefill: it needs that position's logits). None: a miss."""
        tokens = _as_tokens(tokens)
        with self._lock:
            best_id, best = None, 0
            for entry_id in self._by_scope.get(scope, ()):
                shared = min(_common_prefix(self._entries[entry_id].tokens, tokens), max_tokens)
                if shared > best:
                    best_id, best = entry_id, shared
            if best_id is None:
                metrics.PREFIX_CACHE_MISSES.inc()
                return None
            self._entries.move_to_end(best_id)
            entry = self._entries[best_id]
            metrics.PREFIX_CACHE_HITS.inc()
            metrics.PREFIX_CACHE_HIT_TOKENS.inc(best)
            return PrefixHit(best, tuple((k[..., :best, :], v[..., :best, :]) for k, v in entry.kv))

    def store(self, scope: CacheScope, tokens: np.ndarray, kv: PrefixKV) -> bool:
        """Keep ``kv`` (positions [0, len(tokens))) for ``scope``; the cache owns the tensors from here
        (the caller must not write to them). False when not kept: disabled, larger than the budget, or
        already covered by an entry that extends it (that entry is refreshed instead)."""
        tokens = _as_tokens(tokens)
        _check_kv(kv, len(tokens))
        nbytes = kv_bytes(kv)
        if not self.enabled or nbytes > self.budget_bytes or len(tokens) == 0:
            return False
        with self._lock:
            ids = self._by_scope.setdefault(scope, set())
            for entry_id in list(ids):
                entry = self._entries[entry_id]
                shared = _common_prefix(entry.tokens, tokens)
                if shared == len(tokens):  # already covered (equal, or a longer entry extends it)
                    self._entries.move_to_end(entry_id)
                    return False
                if shared == len(entry.tokens):  # the new one extends this entry: it serves everything it did
                    self._remove(entry_id)
            entry_id = next(self._ids)
            self._entries[entry_id] = _Entry(scope, tokens.copy(), kv, nbytes)
            self._by_scope.setdefault(scope, set()).add(entry_id)
            self._bytes += nbytes
            while self._bytes > self.budget_bytes:
                self._remove(next(iter(self._entries)))
                metrics.PREFIX_CACHE_EVICTIONS.inc()
            metrics.PREFIX_CACHE_BYTES.set(self._bytes)
            return True

    def drop_adapter(self, checkpoint_key: str) -> int:
        """Forget every entry computed with ``checkpoint_key`` (it was reloaded or dropped). Returns how many."""
        with self._lock:
            gone = [i for i, e in self._entries.items() if e.scope.checkpoint_key == checkpoint_key]
            for entry_id in gone:
                self._remove(entry_id)
            metrics.PREFIX_CACHE_BYTES.set(self._bytes)
            return len(gone)

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._bytes -= entry.nbytes
        ids = self._by_scope[entry.scope]
        ids.discard(entry_id)
        if not ids:
            del self._by_scope[entry.scope]


def _as_tokens(tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"prefix tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
    return tokens.astype(np.int64, copy=False)


def _check_kv(kv: PrefixKV, n: int) -> None:
    if not kv:
        raise ValueError("prefix KV has no layers")
    for i, layer in enumerate(kv):
        if len(layer) != 2 or any(t.dim() < 2 or t.shape[-2] != n for t in layer):
            raise ValueError(f"prefix KV layer {i} must be (keys, values) covering {n} positions on axis -2, got "
                             f"{[tuple(t.shape) for t in layer]}")
