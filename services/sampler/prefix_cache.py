"""A prompt-prefix KV cache for the torch sampler: the keys and values a prompt's prefill computed,
kept so a later request of the same sampling session, on the same adapter, that starts with the same
tokens prefills only the rest (RL samples one prompt in many requests; multi-turn prompts extend the
previous turn's).

Isolation: an entry belongs to one ``CacheScope`` (tenant, sampling session, checkpoint key and the
adapter's load generation), and a lookup only reads entries of its own scope, so nothing is shared
across tenants, sessions, adapters or versions of one adapter (a reload under the same key bumps its
generation; ``drop_adapter`` also frees the old entries at once).

Two kinds of hit. A *full* hit: the same prompt again. The entry also keeps the logits of the last
position of each prompt that ended in it (``ends``), so the request reuses the stored KV and logits
and decodes bit for bit as the request that stored them (RL's group of samples of one prompt, a
request streamed after the same one unstreamed). A *partial* hit: a longer prompt that extends a
cached one (multi-turn); the caller prefills only the rest over the cached KV, which may round the
last float32 bits differently from prefilling the whole prompt at once.

Matching is at token granularity: the KV at position i depends only on tokens[:i + 1] (causal
attention), so any entry's first m positions serve a prompt that shares its first m tokens. Blocks
would waste up to a block per hit on short RL prompts and buy nothing here: a scope holds a handful of
entries, compared with one vectorised comparison each. An entry that is a prefix of a newer entry
with the very same KV bits there (the newer one was prefilled over it) is merged into it, ends and
all, so multi-turn sessions keep one growing entry; KV computed apart (same tokens, other bits) is
kept apart, so a full hit never pairs logits with KV that did not produce them.

Memory is bounded by ``budget_bytes`` (the tensors' bytes, KV and logits); the least recently used
entries, of any scope, are evicted first. An entry larger than the whole budget is not stored.
Budget 0 disables.

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
    logits: torch.Tensor | None = None  # a full hit: the stored last-position logits of this very prompt


@dataclass
class _Entry:
    scope: CacheScope
    tokens: np.ndarray
    kv: PrefixKV
    nbytes: int
    ends: dict[int, torch.Tensor]  # prompt length -> the logits its last position gave (the next token's)


def kv_bytes(kv: PrefixKV) -> int:
    return sum(t.numel() * t.element_size() for layer in kv for t in layer)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _same_bits(a: PrefixKV, b: PrefixKV, n: int) -> bool:
    """Whether ``a`` and ``b`` hold the very same values at positions [0, n)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape[:-2] == y.shape[:-2] and torch.equal(x[..., :n, :], y[..., :n, :])
        for la, lb in zip(a, b) for x, y in zip(la, lb))


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

    def lookup(self, scope: CacheScope, tokens: np.ndarray, max_tokens: int, whole: bool = False) -> PrefixHit | None:
        """The longest cached prefix of ``tokens`` in ``scope``, at most ``max_tokens`` long (the caller
        keeps at least the last token to prefill: it needs that position's logits). With ``whole``, an
        entry that holds this very prompt's last logits is a full hit instead (all tokens, and the
        logits). None: a miss."""
        tokens = _as_tokens(tokens)
        n = len(tokens)
        with self._lock:
            best_id, best, logits = None, 0, None
            for entry_id in self._by_scope.get(scope, ()):
                entry = self._entries[entry_id]
                shared = _common_prefix(entry.tokens, tokens)
                if whole and shared == n and n in entry.ends:
                    best_id, best, logits = entry_id, n, entry.ends[n]
                    break
                if min(shared, max_tokens) > best:
                    best_id, best = entry_id, min(shared, max_tokens)
            if best_id is None:
                metrics.PREFIX_CACHE_MISSES.inc()
                return None
            self._entries.move_to_end(best_id)
            entry = self._entries[best_id]
            metrics.PREFIX_CACHE_HITS.inc()
            metrics.PREFIX_CACHE_HIT_TOKENS.inc(best)
            return PrefixHit(best, tuple((k[..., :best, :], v[..., :best, :]) for k, v in entry.kv), logits)

    def store(self, scope: CacheScope, tokens: np.ndarray, kv: PrefixKV, logits: torch.Tensor | None = None) -> bool:
        """Keep ``kv`` (positions [0, len(tokens))) for ``scope``, and ``logits`` (the last position's,
        for a later full hit); the cache owns the tensors from here (the caller must not write to
        them). False when no new entry is kept: disabled, larger than the budget, or already covered
        by an entry with these KV bits (that entry is refreshed, and takes ``logits``)."""
        tokens = _as_tokens(tokens)
        n = len(tokens)
        _check_kv(kv, n)
        nbytes = kv_bytes(kv) + _nbytes(logits)
        if not self.enabled or nbytes > self.budget_bytes or n == 0:
            return False
        with self._lock:
            ends = {} if logits is None else {n: logits}
            for entry_id in list(self._by_scope.get(scope, ())):
                entry = self._entries[entry_id]
                shared = _common_prefix(entry.tokens, tokens)
                if shared == n and _same_bits(entry.kv, kv, n):  # equal, or a longer entry extends it
                    self._entries.move_to_end(entry_id)
                    if logits is not None and n not in entry.ends:
                        entry.ends[n] = logits
                        entry.nbytes += _nbytes(logits)
                        self._bytes += _nbytes(logits)
                        self._evict()
                    return False
                if shared == len(entry.tokens) and _same_bits(entry.kv, kv, shared):
                    ends = entry.ends | ends  # the new one extends this entry with its very KV: it serves all of it
                    nbytes += sum(_nbytes(t) for t in entry.ends.values())
                    self._remove(entry_id)
            entry_id = next(self._ids)
            self._entries[entry_id] = _Entry(scope, tokens.copy(), kv, nbytes, ends)
            self._by_scope.setdefault(scope, set()).add(entry_id)
            self._bytes += nbytes
            self._evict()
            return entry_id in self._entries

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes:
            self._remove(next(iter(self._entries)))
            metrics.PREFIX_CACHE_EVICTIONS.inc()
        metrics.PREFIX_CACHE_BYTES.set(self._bytes)

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
