"""The prompt-prefix KV cache without a model: fake per-layer KV tensors whose values name their
position, so a hit's tensors can be checked position by position."""

import numpy as np
import pytest
import torch

from temper.services.sampler import metrics
from temper.services.sampler.prefix_cache import CacheScope, PrefixCache, kv_bytes

LAYERS, HEADS, DIM = 2, 2, 4
SCOPE = CacheScope("tenant-a", "sampler-1", None)


def fake_kv(tokens, layers=LAYERS):
    """(1, heads, n, dim) per layer; position i of layer l holds 1000 * l + tokens[i] (keys) and its negative (values)."""
    t = torch.tensor(np.asarray(tokens), dtype=torch.float32)
    return tuple((
        (1000 * l + t)[None, None, :, None].expand(1, HEADS, len(tokens), DIM).clone(),
        -(1000 * l + t)[None, None, :, None].expand(1, HEADS, len(tokens), DIM).clone(),
    ) for l in range(layers))


def entry_bytes(n):
    return kv_bytes(fake_kv(list(range(n))))


def counter(c) -> float:
    return c._value.get()


def test_longest_prefix_at_token_granularity_and_exact_kv():
    cache = PrefixCache(1 << 20)
    assert cache.store(SCOPE, np.array([5, 6, 7, 8, 9]), fake_kv([5, 6, 7, 8, 9]))
    hit = cache.lookup(SCOPE, np.array([5, 6, 7, 1, 2, 3]), max_tokens=5)
    assert hit.tokens == 3
    for l, (k, v) in enumerate(hit.kv):
        assert k.shape == (1, HEADS, 3, DIM)
        torch.testing.assert_close(k[0, 0, :, 0], torch.tensor([5.0, 6, 7]) + 1000 * l, rtol=0, atol=0)
        torch.testing.assert_close(v[0, 1, :, 3], -(torch.tensor([5.0, 6, 7]) + 1000 * l), rtol=0, atol=0)
    # the cap keeps the caller's last token to prefill
    assert cache.lookup(SCOPE, np.array([5, 6, 7, 8, 9]), max_tokens=4).tokens == 4
    assert cache.lookup(SCOPE, np.array([4, 5, 6]), max_tokens=2) is None


def test_the_longest_of_several_entries_wins():
    cache = PrefixCache(1 << 20)
    cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]))
    cache.store(SCOPE, np.array([1, 9, 9, 9]), fake_kv([1, 9, 9, 9]))
    hit = cache.lookup(SCOPE, np.array([1, 9, 9, 4, 4]), max_tokens=4)
    assert hit.tokens == 3
    assert hit.kv[0][0][0, 0, :, 0].tolist() == [1.0, 9.0, 9.0]


@pytest.mark.parametrize("other", [
    CacheScope("tenant-b", "sampler-1", None),          # another tenant, same session id
    CacheScope("tenant-a", "sampler-2", None),          # another session
    CacheScope("tenant-a", "sampler-1", "ckpt"),         # an adapter instead of the base model
])
def test_never_shared_across_tenants_sessions_or_adapters(other):
    cache = PrefixCache(1 << 20)
    cache.store(SCOPE, np.array([1, 2, 3, 4]), fake_kv([1, 2, 3, 4]))
    assert cache.lookup(other, np.array([1, 2, 3, 4]), max_tokens=3) is None
    assert cache.lookup(SCOPE, np.array([1, 2, 3, 4]), max_tokens=3).tokens == 3


def test_adapter_versions_are_separate_and_drop_adapter_frees_them():
    cache = PrefixCache(1 << 20)
    v1, v2 = CacheScope("t", "s", "ckpt", 1), CacheScope("t", "s", "ckpt", 2)
    cache.store(v1, np.array([1, 2, 3]), fake_kv([1, 2, 3]))
    assert cache.lookup(v2, np.array([1, 2, 3]), max_tokens=2) is None
    cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]))
    assert cache.drop_adapter("ckpt") == 1
    assert cache.lookup(v1, np.array([1, 2, 3]), max_tokens=2) is None
    assert len(cache) == 1 and cache.bytes == entry_bytes(3)  # the base model's entry stays


def test_an_extension_replaces_its_prefix_and_a_prefix_is_not_stored_twice():
    cache = PrefixCache(1 << 20)
    assert cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]))
    assert cache.store(SCOPE, np.array([1, 2, 3, 4, 5]), fake_kv([1, 2, 3, 4, 5]))  # the next turn
    assert len(cache) == 1 and cache.bytes == entry_bytes(5)
    assert not cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]))  # covered by the longer entry
    assert len(cache) == 1 and cache.bytes == entry_bytes(5)


def test_lru_eviction_within_the_byte_budget():
    cache = PrefixCache(3 * entry_bytes(4))
    evicted = counter(metrics.PREFIX_CACHE_EVICTIONS)
    for first in (10, 20, 30):
        cache.store(SCOPE, np.array([first, 1, 2, 3]), fake_kv([first, 1, 2, 3]))
    assert cache.lookup(SCOPE, np.array([10, 1, 2, 3]), max_tokens=3).tokens == 3  # 10 is now the most recent
    cache.store(SCOPE, np.array([40, 1, 2, 3]), fake_kv([40, 1, 2, 3]))  # over budget: 20 goes
    assert counter(metrics.PREFIX_CACHE_EVICTIONS) - evicted == 1
    assert cache.lookup(SCOPE, np.array([20, 1, 2, 3]), max_tokens=3) is None
    for kept in (10, 30, 40):
        assert cache.lookup(SCOPE, np.array([kept, 1, 2, 3]), max_tokens=3).tokens == 3
    assert cache.bytes == 3 * entry_bytes(4) and metrics.PREFIX_CACHE_BYTES._value.get() == cache.bytes


def test_an_entry_over_the_budget_and_a_zero_budget_store_nothing():
    small = PrefixCache(entry_bytes(3))
    assert not small.store(SCOPE, np.arange(4), fake_kv(list(range(4))))
    assert small.store(SCOPE, np.arange(3), fake_kv(list(range(3))))
    off = PrefixCache(0)
    assert not off.enabled and not off.store(SCOPE, np.arange(3), fake_kv(list(range(3))))
    assert off.lookup(SCOPE, np.arange(3), max_tokens=2) is None and len(off) == 0


def test_hit_and_miss_metrics():
    cache = PrefixCache(1 << 20)
    hits, misses, tokens = (counter(c) for c in (metrics.PREFIX_CACHE_HITS, metrics.PREFIX_CACHE_MISSES,
                                                 metrics.PREFIX_CACHE_HIT_TOKENS))
    cache.lookup(SCOPE, np.arange(5), max_tokens=4)
    cache.store(SCOPE, np.arange(5), fake_kv(list(range(5))))
    cache.lookup(SCOPE, np.arange(5), max_tokens=4)
    assert counter(metrics.PREFIX_CACHE_MISSES) - misses == 1
    assert counter(metrics.PREFIX_CACHE_HITS) - hits == 1
    assert counter(metrics.PREFIX_CACHE_HIT_TOKENS) - tokens == 4


def test_bad_input_is_refused_and_changes_nothing():
    cache = PrefixCache(1 << 20)
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="covering 3 positions"):
        cache.store(SCOPE, np.arange(3), fake_kv(list(range(4))))
    with pytest.raises(ValueError, match="1-D integer"):
        cache.store(SCOPE, np.zeros(3, dtype=np.float32), fake_kv([0, 0, 0]))
    with pytest.raises(ValueError, match="no layers"):
        cache.store(SCOPE, np.arange(3), ())
    assert len(cache) == 0 and cache.bytes == 0


def test_stored_tensors_are_not_copied_and_hits_are_views():
    """The cache owns what it is given (no hidden copy doubles the memory it accounts for)."""
    cache = PrefixCache(1 << 20)
    kv = fake_kv([1, 2, 3])
    cache.store(SCOPE, np.array([1, 2, 3]), kv)
    hit = cache.lookup(SCOPE, np.array([1, 2, 3]), max_tokens=2)
    assert hit.kv[0][0].data_ptr() == kv[0][0].data_ptr()


def test_the_clients_sample_response_carries_the_hit_tokens():
    from temper.client.convert import sample_from_proto
    from temper.v1 import types_pb2

    assert sample_from_proto(types_pb2.SampleResponse(prompt_cache_hit_tokens=17)).prompt_cache_hit_tokens == 17
    assert sample_from_proto(types_pb2.SampleResponse()).prompt_cache_hit_tokens == 0


def logits(value, vocab=8):
    return torch.full((vocab,), float(value))


def test_a_full_hit_returns_the_stored_logits_of_that_very_prompt():
    cache = PrefixCache(1 << 20)
    cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]), logits(3))
    hit = cache.lookup(SCOPE, np.array([1, 2, 3]), max_tokens=2, whole=True)
    assert hit.tokens == 3 and hit.logits.tolist() == [3.0] * 8 and hit.kv[0][0].shape[-2] == 3
    assert cache.lookup(SCOPE, np.array([1, 2, 3]), max_tokens=2).logits is None  # not asked: a partial hit of 2
    assert cache.lookup(SCOPE, np.array([1, 2]), max_tokens=1, whole=True).logits is None  # no logits for [1, 2]
    # a longer prompt over it keeps the ends of the entry it extends (the same KV bits there)
    assert cache.store(SCOPE, np.array([1, 2, 3, 4]), fake_kv([1, 2, 3, 4]), logits(4))
    assert len(cache) == 1 and cache.bytes == entry_bytes(4) + 2 * logits(0).numel() * 4
    assert cache.lookup(SCOPE, np.array([1, 2, 3]), max_tokens=2, whole=True).logits.tolist() == [3.0] * 8
    assert cache.lookup(SCOPE, np.array([1, 2, 3, 4]), max_tokens=3, whole=True).logits.tolist() == [4.0] * 8
    # the same tokens stored again with the same KV only add their logits to the entry that holds them
    assert not cache.store(SCOPE, np.array([1, 2]), fake_kv([1, 2]), logits(2))
    assert len(cache) == 1 and cache.lookup(SCOPE, np.array([1, 2]), max_tokens=1, whole=True).logits[0] == 2.0


def test_kv_computed_apart_is_never_paired_with_another_computations_logits():
    """The same tokens with other KV bits (prefilled in another batch layout) stay a separate entry: a full
    hit always returns the KV and logits of one computation."""
    cache = PrefixCache(1 << 20)
    cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]), logits(3))
    other = tuple((k + 1e-6, v) for k, v in fake_kv([1, 2, 3, 4]))  # its first 3 positions differ in the last bits
    assert cache.store(SCOPE, np.array([1, 2, 3, 4]), other, logits(4))
    assert len(cache) == 2
    hit = cache.lookup(SCOPE, np.array([1, 2, 3]), max_tokens=2, whole=True)
    assert hit.logits[0] == 3.0 and torch.equal(hit.kv[0][0], fake_kv([1, 2, 3])[0][0])
    hit = cache.lookup(SCOPE, np.array([1, 2, 3, 4]), max_tokens=3, whole=True)
    assert hit.logits[0] == 4.0 and torch.equal(hit.kv[0][0], other[0][0])


def test_logits_count_against_the_budget():
    cache = PrefixCache(entry_bytes(3) + 8 * 4)
    assert cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]), logits(3))
    assert cache.bytes == cache.budget_bytes
    assert not cache.store(SCOPE, np.array([1, 2, 3]), fake_kv([1, 2, 3]), torch.zeros(9))  # over the whole budget
    assert cache.store(SCOPE, np.array([5, 6, 7]), fake_kv([5, 6, 7]), logits(7))  # evicts the first
    assert len(cache) == 1 and cache.bytes <= cache.budget_bytes
