"""The torch sampler's prefix cache on the tiny model, with and without a LoRA adapter: the same prompt
again (a full hit) decodes bit for bit as the request that stored it (tokens and logprobs, sampled
with a seed, streamed or not); a longer prompt over a cached prefix (a partial hit) decodes the same
greedy tokens with logprobs within PARTIAL_BOUND of the batched prefill without any cache (the
reference: ``prompt_prefill`` off); each distinct prompt of a batch is prefilled once, the misses in
one forward; hits are reported per request and never cross sessions, tenants or adapter versions;
memory stays within the budget; deterministic requests and prompts with images bypass the cache."""

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
SAMPLED = SamplingOptions(max_tokens=6, temperature=0.9, seed=5, stop_disabled=True)
PARTIAL_BOUND = 1e-5  # the tiny model's (measured <= 1e-6); the docs state 5e-5 (SmolLM2 measured 1.3e-5)
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


def request(tokens, key=None, session="client-1", tenant="tenant-a", num_samples=1, options=GREEDY, **kw):
    return SampleRequest(key, tokens, num_samples, options, cache_session=session, tenant=tenant, **kw)


def assert_same_decode(got, want, atol=PARTIAL_BOUND):
    assert len(got.sequences) == len(want.sequences)
    for g, w in zip(got.sequences, want.sequences):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=atol)


def assert_same_bits(got, want):
    """Tokens, logprobs, top-k and stop reasons equal bit for bit (the SampleStream contract)."""
    assert len(got.sequences) == len(want.sequences)
    for g, w in zip(got.sequences, want.sequences):
        assert (g.tokens, g.stop_reason, g.topk_ids) == (w.tokens, w.stop_reason, w.topk_ids)
        assert np.array_equal(np.float32(g.logprobs), np.float32(w.logprobs))
        assert g.topk_logprobs == w.topk_logprobs


def prefill_forwards(backend):
    """Records the shape of every prefill forward (more than one input position) of ``backend``'s model."""
    shapes = []
    hook = backend.loaded.model.register_forward_pre_hook(
        lambda _m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape))
        if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    return shapes, hook


@pytest.mark.parametrize("key", [None, "a"])
def test_a_full_hit_is_bit_identical_to_the_miss_before_it(cached, reference, key):
    base = prompt(24, seed=3 if key else 4)
    session = f"same-prompt-{key}"
    ask = dict(key=key, session=session, num_samples=3, options=SAMPLED, topk_logprobs=2)
    first = cached.sample_batch([request(base, **ask)])[0]
    again = cached.sample_batch([request(base, **ask)])[0]
    assert (first.prompt_cache_hit_tokens, again.prompt_cache_hit_tokens) == (0, len(base))
    assert_same_bits(again, first)
    pieces = []
    streamed = cached.sample_batch([request(base, **ask, progress=pieces.extend)])[0]  # SampleStream's path
    assert streamed.prompt_cache_hit_tokens == len(base)
    assert_same_bits(streamed, first)
    for k, seq in enumerate(first.sequences):
        assert [t for p in pieces if p.sequence == k for t in p.tokens] == seq.tokens
        assert np.array_equal(np.float32([x for p in pieces if p.sequence == k for x in p.logprobs]), np.float32(seq.logprobs))
    # the miss itself prefilled the prompt alone (one row, last position's logits only): within the bound of
    # the reference's batched prefill, same greedy tokens
    assert_same_decode(cached.sample_batch([request(base, key, f"{session}-greedy")])[0],
                       reference.sample_batch([request(base, key)])[0])


@pytest.mark.parametrize("key", [None, "a"])
def test_a_partial_hit_is_within_the_bound_and_its_repeat_is_bit_identical(cached, reference, key):
    base = prompt(20, seed=13 if key else 14)
    session = f"multi-turn-{key}"
    first = cached.sample_batch([request(base, key, session)])[0]
    turn = np.concatenate([base, np.array(first.sequences[0].tokens, dtype=np.int32), prompt(5, seed=9)])
    extended = cached.sample_batch([request(turn, key, session)])[0]
    assert extended.prompt_cache_hit_tokens == len(base)  # only the new tokens were prefilled
    assert_same_decode(extended, reference.sample_batch([request(turn, key)])[0])
    assert len(cached.prefix_cache._by_scope[cached._cache_scope(request(turn, key, session))]) == 1  # one growing entry
    again = cached.sample_batch([request(turn, key, session)])[0]
    assert again.prompt_cache_hit_tokens == len(turn)
    assert_same_bits(again, extended)
    # the first turn again: still a full hit on the merged entry (its logits kept), bit for bit
    repeat = cached.sample_batch([request(base, key, session)])[0]
    assert repeat.prompt_cache_hit_tokens == len(base)
    assert_same_bits(repeat, first)


@pytest.mark.parametrize("key", [None, "a"])
def test_partial_hits_of_several_lengths_and_a_miss_prefill_in_one_forward(cached, reference, key):
    """RL prompts sharing a cached system prompt, multi-turn prompts over their last turn: one forward for
    all of them (each row's prefix as the past, gaps masked), each within the bound of an uncached prefill."""
    system, turn = prompt(12, seed=200), prompt(18, seed=201)
    session = f"partial-batch-{key}"
    cached.sample_batch([request(system, key, session), request(turn, key, session)])
    batch = [request(np.concatenate([system, prompt(6 + i, seed=210 + i)]), key, session) for i in range(3)]
    batch += [request(np.concatenate([turn, prompt(4, seed=220)]), key, session), request(prompt(7, seed=230), key, session)]
    shapes, hook = prefill_forwards(cached)
    try:
        got = cached.sample_batch(batch)
    finally:
        hook.remove()
    assert [r.prompt_cache_hit_tokens for r in got] == [12, 12, 12, 18, 0]
    assert shapes == [(5, 8)]  # one forward: the longest rest (6 + 2 tokens) after the longest prefix
    want = reference.sample_batch(batch)
    for g, w in zip(got, want):
        assert_same_decode(g, w)
    again = cached.sample_batch(batch)  # every prompt now whole in the cache: full hits, the same bits
    assert [r.prompt_cache_hit_tokens for r in again] == [len(r.prompt) for r in batch]
    for g, w in zip(again, got):
        assert_same_bits(g, w)


def test_a_mixed_batch_of_hits_misses_and_prompt_scores_matches_the_reference(cached, reference):
    shared, other, third = prompt(16, seed=11), prompt(9, seed=12), prompt(13, seed=15)
    cached.sample_batch([request(shared, "a", "mixed")])
    batch = [request(shared, "a", "mixed", num_samples=3), request(other, None, "mixed"), request(third, "a", "mixed"),
             request(shared, None, "mixed", prompt_logprobs=True, topk_prompt_logprobs=2)]
    shapes, hook = prefill_forwards(cached)
    try:
        got = cached.sample_batch(batch)
    finally:
        hook.remove()
    assert [r.prompt_cache_hit_tokens for r in got] == [len(shared), 0, 0, 0]  # prompt scoring needs every position
    assert shapes == [(2, len(third)), (1, len(shared))]  # the two misses together (two adapters), the scored one apart
    want = reference.sample_batch(batch)
    for g, w in zip(got, want):
        assert_same_decode(g, w)
    np.testing.assert_allclose(got[3].prompt_logprobs, want[3].prompt_logprobs, rtol=0, atol=PARTIAL_BOUND)
    np.testing.assert_array_equal(got[3].topk_prompt_ids, want[3].topk_prompt_ids)


def test_a_group_prefills_its_prompt_once(cached, reference):
    tokens = prompt(32, seed=21)
    shapes, hook = prefill_forwards(cached)
    try:
        got = [cached.sample_batch([request(tokens, "a", "group-of-8", options=SAMPLED)])[0] for _ in range(8)]
        one = cached.sample_batch([request(tokens, "a", "group-in-one", num_samples=8, options=SAMPLED)])[0]
        distinct = [prompt(10 + i, seed=100 + i) for i in range(8)]
        cached.sample_batch([request(t, None, "") for t in distinct])  # no session: still one forward
    finally:
        hook.remove()
    assert [r.prompt_cache_hit_tokens for r in got] == [0] + [len(tokens)] * 7
    for r in got[1:]:
        assert_same_bits(r, got[0])
    assert one.prompt_cache_hit_tokens == 0 and len({tuple(s.tokens) for s in one.sequences}) > 1  # 8 rows, sampled apart
    assert shapes == [(1, len(tokens)), (1, len(tokens)), (8, 17)]
    assert_same_decode(cached.sample_batch([request(tokens, "a", "group-greedy")])[0],
                       reference.sample_batch([request(tokens, "a")])[0])


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
    old_scope = backend._cache_scope(request(tokens, "a"))
    assert len(backend.prefix_cache) == 1
    backend.load_adapter("a", adapters[0])  # a new version under the same key
    assert len(backend.prefix_cache) == 0 and backend._cache_scope(request(tokens, "a")) != old_scope
    got = backend.sample_batch([request(tokens, "a")])[0]
    assert got.prompt_cache_hit_tokens == 0
    assert_same_decode(got, reference.sample_batch([request(tokens, "a")])[0])


def test_memory_stays_within_the_budget(tiny_model_dir):
    backend = TorchSamplerBackend(load_model(tiny_model_dir), prefix_cache_bytes=1)
    backend.sample_batch([request(prompt(16, seed=70), None, "probe")])
    assert len(backend.prefix_cache) == 0  # one entry is over a 1-byte budget: nothing kept
    probe = TorchSamplerBackend(load_model(tiny_model_dir), prefix_cache_bytes=64 << 20)
    probe.sample_batch([request(prompt(16, seed=70), None, "probe")])
    entry = probe.prefix_cache.bytes  # KV and logits of one 16-token prompt
    backend.prefix_cache = type(backend.prefix_cache)(int(2.5 * entry))
    for i in range(6):
        backend.sample_batch([request(prompt(16, seed=80 + i), None, f"session-{i % 2}")])
        assert backend.prefix_cache.bytes <= backend.prefix_cache.budget_bytes
    assert len(backend.prefix_cache) == 2
    # the two most recent stay (full hits); the first ones were evicted
    assert backend.sample_batch([request(prompt(16, seed=85), None, "session-1")])[0].prompt_cache_hit_tokens == 16
    assert backend.sample_batch([request(prompt(16, seed=80), None, "session-0")])[0].prompt_cache_hit_tokens == 0


def test_deterministic_requests_and_images_bypass_the_cache(cached, reference):
    tokens = prompt(14, seed=51)
    cached.sample_batch([request(tokens, None, "det")])  # the prefix is cached for this session ...
    got = cached.sample_batch([request(tokens, None, "det", deterministic=True)])[0]
    want = reference.sample_batch([request(tokens, None, deterministic=True)])[0]
    assert got.prompt_cache_hit_tokens == 0  # ... and not used by the batch-invariant decode
    for g, w in zip(got.sequences, want.sequences):
        assert g.tokens == w.tokens and g.logprobs == w.logprobs  # the same bits
    assert cached._cache_scope(request(tokens, None, "det", images=(object(),))) is None  # images: no scope


def test_hit_tokens_travel_in_the_response_and_a_half_scope_is_refused(cached):
    tokens = prompt(10, seed=61)
    pb = sampler_pb2.SamplerSampleRequest(prompt_tokens=tokens.astype("<i4").tobytes(), num_samples=1,
                                          sampling_params=types_pb2.SamplingParams(max_tokens=2, temperature=0.0),
                                          sampling_session_id="client-pb", tenant="tenant-a")
    results = [cached.sample_batch([convert.sample_request_from_pb(pb, cached.loaded.vocab_size, 8)])[0]
               for _ in range(2)]
    assert [convert.sample_result_to_pb(r, 0).prompt_cache_hit_tokens for r in results] == [0, len(tokens)]
    held = len(cached.prefix_cache)
    pb.tenant = ""
    with pytest.raises(InvalidArgument, match="sampling_session_id and tenant"):
        convert.sample_request_from_pb(pb, cached.loaded.vocab_size, 8)
    assert len(cached.prefix_cache) == held


def test_a_vision_model_keeps_the_batched_prefill_and_caches_nothing(vl_model_dirs):
    """Multimodal positions: a prompt's tokens alone do not name its KV, so vision models never cache."""
    backend = TorchSamplerBackend(load_model(vl_model_dirs[next(iter(vl_model_dirs))]), prefix_cache_bytes=64 << 20)
    assert not backend.prompt_prefill and not backend.prefix_cache.enabled
    tokens = prompt(10, seed=90)
    hits = [backend.sample_batch([request(tokens, None, "vl")])[0].prompt_cache_hit_tokens for _ in range(2)]
    assert hits == [0, 0] and len(backend.prefix_cache) == 0
