"""The torch sampler's prefix cache on the tiny model: a request whose prompt prefix is cached decodes
the same greedy tokens, with logprobs within 1e-5, as the batched prefill without any cache (the
reference: ``prompt_prefill`` off), with and without a LoRA adapter; hits are reported per request and
never cross sessions, tenants or adapter versions; deterministic requests bypass the cache."""

import numpy as np
import pytest
import torch

from temper.common.errors import InvalidArgument
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import load_model
from temper.services.sampler import convert
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, types_pb2

GREEDY = SamplingOptions(max_tokens=6, temperature=0.0, stop_disabled=True)
SPEC = AdapterSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))


def write_adapter(model_dir, folder, seed):
    scratch = LoraModel(load_model(model_dir).model, model_dir)
    scratch.add("a", SPEC, seed=seed)
    with torch.no_grad():
        for p in scratch.adapters["a"].params.values():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    scratch.save("a", folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return [write_adapter(tiny_model_dir, tmp_path_factory.mktemp(f"adapter-{s}"), s) for s in (1, 2)]


@pytest.fixture(scope="module")
def cached(tiny_model_dir, adapters):
    backend = TorchSamplerBackend(load_model(tiny_model_dir), prefix_cache_bytes=64 << 20)
    assert backend.prompt_prefill and backend.prefix_cache.enabled
    backend.load_adapter("a", adapters[0])
    return backend


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    backend = TorchSamplerBackend(load_model(tiny_model_dir))
    backend.prompt_prefill = False  # the batched, left-padded prefill: no per-prompt path, no cache
    backend.load_adapter("a", adapters[0])
    return backend


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 200, size=n).astype(np.int32)


def request(tokens, key=None, session="client-1", tenant="tenant-a", num_samples=1, **kw):
    return SampleRequest(key, tokens, num_samples, GREEDY, cache_session=session, tenant=tenant, **kw)


def assert_same_decode(got, want):
    assert len(got.sequences) == len(want.sequences)
    for g, w in zip(got.sequences, want.sequences):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("key", [None, "a"])
def test_a_cached_prefix_decodes_as_the_uncached_batch(cached, reference, key):
    base = prompt(24, seed=3 if key else 4)
    session = f"same-prompt-{key}"
    first = cached.sample_batch([request(base, key, session)])[0]
    again = cached.sample_batch([request(base, key, session)])[0]
    assert (first.prompt_cache_hit_tokens, again.prompt_cache_hit_tokens) == (0, len(base) - 1)
    want = reference.sample_batch([request(base, key)])[0]
    assert_same_decode(first, want)
    assert_same_decode(again, want)
    # the next turn extends the prompt: only the new tokens are prefilled
    turn = np.concatenate([base, np.array(again.sequences[0].tokens, dtype=np.int32), prompt(5, seed=9)])
    extended = cached.sample_batch([request(turn, key, session)])[0]
    assert extended.prompt_cache_hit_tokens == len(base)
    assert_same_decode(extended, reference.sample_batch([request(turn, key)])[0])


def test_a_mixed_batch_of_hits_misses_and_prompt_scores_matches_the_reference(cached, reference):
    shared, other = prompt(16, seed=11), prompt(9, seed=12)
    cached.sample_batch([request(shared, "a", "mixed")])
    batch = [request(shared, "a", "mixed", num_samples=3), request(other, None, "mixed"),
             request(shared, None, "mixed", prompt_logprobs=True, topk_prompt_logprobs=2)]
    got = cached.sample_batch(batch)
    assert [r.prompt_cache_hit_tokens for r in got] == [len(shared) - 1, 0, 0]  # prompt scoring needs every position
    want = reference.sample_batch(batch)
    for g, w in zip(got, want):
        assert_same_decode(g, w)
    np.testing.assert_allclose(got[2].prompt_logprobs, want[2].prompt_logprobs, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got[2].topk_prompt_ids, want[2].topk_prompt_ids)


def test_a_group_of_eight_requests_prefills_the_prompt_once(cached, reference):
    tokens = prompt(32, seed=21)
    got = [cached.sample_batch([request(tokens, "a", "group-of-8")])[0] for _ in range(8)]
    assert [r.prompt_cache_hit_tokens for r in got] == [0] + [len(tokens) - 1] * 7
    want = reference.sample_batch([request(tokens, "a")])[0]
    for r in got:
        assert_same_decode(r, want)


@pytest.mark.parametrize("scope", [dict(session="client-2"), dict(tenant="tenant-b"), dict(key=None),
                                   dict(session="")])
def test_no_hit_across_sessions_tenants_adapters_or_without_a_session(cached, scope):
    tokens = prompt(12, seed=31)
    cached.sample_batch([request(tokens, "a", "isolated")])
    args = dict(key="a", session="isolated", tenant="tenant-a") | scope
    assert cached.sample_batch([request(tokens, args.pop("key"), **args)])[0].prompt_cache_hit_tokens == 0


def test_reloading_an_adapter_never_reuses_its_old_kv(tiny_model_dir, adapters, reference):
    backend = TorchSamplerBackend(load_model(tiny_model_dir), prefix_cache_bytes=64 << 20)
    backend.load_adapter("a", adapters[1])
    tokens = prompt(12, seed=41)
    backend.sample_batch([request(tokens, "a")])
    assert len(backend.prefix_cache) == 1
    backend.load_adapter("a", adapters[0])  # a new version under the same key
    assert len(backend.prefix_cache) == 0
    got = backend.sample_batch([request(tokens, "a")])[0]
    assert got.prompt_cache_hit_tokens == 0
    assert_same_decode(got, reference.sample_batch([request(tokens, "a")])[0])


def test_deterministic_requests_bypass_the_cache_and_keep_their_bits(cached, reference):
    tokens = prompt(14, seed=51)
    cached.sample_batch([request(tokens, None, "det")])  # the prefix is cached for this session ...
    got = cached.sample_batch([request(tokens, None, "det", deterministic=True)])[0]
    want = reference.sample_batch([request(tokens, None, deterministic=True)])[0]
    assert got.prompt_cache_hit_tokens == 0  # ... and not used by the batch-invariant decode
    for g, w in zip(got.sequences, want.sequences):
        assert g.tokens == w.tokens and g.logprobs == w.logprobs  # the same bits


def test_hit_tokens_travel_in_the_response_and_a_half_scope_is_refused(cached):
    tokens = prompt(10, seed=61)
    pb = sampler_pb2.SamplerSampleRequest(prompt_tokens=tokens.astype("<i4").tobytes(), num_samples=1,
                                          sampling_params=types_pb2.SamplingParams(max_tokens=2, temperature=0.0),
                                          sampling_session_id="client-pb", tenant="tenant-a")
    results = [cached.sample_batch([convert.sample_request_from_pb(pb, cached.loaded.vocab_size, 8)])[0]
               for _ in range(2)]
    assert [convert.sample_result_to_pb(r, 0).prompt_cache_hit_tokens for r in results] == [0, len(tokens) - 1]
    held = len(cached.prefix_cache)
    pb.tenant = ""
    with pytest.raises(InvalidArgument, match="sampling_session_id and tenant"):
        convert.sample_request_from_pb(pb, cached.loaded.vocab_size, 8)
    assert len(cached.prefix_cache) == held
