"""Prometheus series of the sampler process (default registry; served by common.metrics.serve_metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BATCH_SEQUENCES = Histogram("temper_sampler_batch_sequences", "Sequences decoded together in one batch.",
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
TOKENS_SAMPLED = Counter("temper_sampler_tokens_sampled", "Tokens generated, over all sequences.")
SAMPLE_SECONDS = Histogram("temper_sampler_sample_seconds", "Latency of one Sample request, queueing included.",
                           buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120))
RESIDENT_ADAPTERS = Gauge("temper_sampler_resident_adapters", "Checkpoints whose LoRA weights are loaded.")
RESIDENT_ADAPTER_BYTES = Gauge("temper_sampler_resident_adapter_bytes", "Bytes of the loaded adapters' pushed files.")
EVICTIONS = Counter("temper_sampler_adapter_evictions", "Adapters dropped to make room (least recently used first).")
# Failed RPCs are counted by the error interceptor, as every service's: temper_rpc_errors_total (common/metrics.py).
# The prompt-prefix KV cache (prefix_cache.py): lookups that reused a prefix or found none, the prompt
# tokens not prefilled thanks to it, entries evicted for the byte budget, and the bytes it holds now.
PREFIX_CACHE_HITS = Counter("temper_sampler_prefix_cache_hits", "Prefix-cache lookups that reused a cached prefix.")
PREFIX_CACHE_MISSES = Counter("temper_sampler_prefix_cache_misses", "Prefix-cache lookups that found no prefix.")
PREFIX_CACHE_HIT_TOKENS = Counter("temper_sampler_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the cache.")
PREFIX_CACHE_EVICTIONS = Counter("temper_sampler_prefix_cache_evictions", "Prefix-cache entries evicted (LRU) for the "
                                                                           "byte budget.")
PREFIX_CACHE_BYTES = Gauge("temper_sampler_prefix_cache_bytes", "Bytes of KV tensors the prefix cache holds.")
