"""The torch sampler backend in-process: mixed-adapter batches equal per-adapter decoding,
sampling options behave, and prompt logprobs match a direct computation. Also the sampler's
protobuf conversion and its metrics, through the servicer without a server."""

import asyncio

import numpy as np
import pytest
import torch

from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_tokens
from temper.common.errors import AdapterNotLoaded, InvalidArgument
from temper.services.sampler import convert
from temper.services.sampler.servicer import SamplerServicer
from temper.v1 import sampler_pb2, types_pb2
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import load_model
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.torch_backend import TorchSamplerBackend

SPECS = {
    "x": AdapterSpec(rank=2, alpha=4, targets=("q_proj", "v_proj")),
    "y": AdapterSpec(rank=8, alpha=8, targets=("gate_proj", "lm_head", "up_proj")),
    "z": AdapterSpec(rank=4, alpha=16, targets=("down_proj", "k_proj", "o_proj", "q_proj")),
}


@pytest.fixture(scope="module")
def backend(tiny_model_dir, tmp_path_factory):
    backend = TorchSamplerBackend(load_model(tiny_model_dir))
    # Adapters travel as peft folders: write each one with a LoraModel on a scratch copy.
    scratch = LoraModel(load_model(tiny_model_dir).model, tiny_model_dir)
    for i, (key, spec) in enumerate(SPECS.items()):
        scratch.add(key, spec, seed=i)
        with torch.no_grad():
            for p in scratch.adapters[key].params.values():
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(i))
        folder = tmp_path_factory.mktemp(f"adapter-{key}")
        scratch.save(key, folder)
        backend.load_adapter(key, folder)
    return backend


GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, stop_disabled=True)


def test_mixed_adapter_batch_matches_one_request_at_a_time(backend):
    rng = np.random.default_rng(0)
    requests = [SampleRequest(key, rng.integers(3, 500, n).astype(np.int32), samples, GREEDY, prompt_logprobs=True)
                for key, n, samples in [("x", 5, 2), (None, 9, 1), ("y", 3, 1), ("z", 12, 2), ("x", 7, 1)]]
    batched = backend.sample_batch(requests)
    for request, got in zip(requests, batched):
        want = backend.sample(request.checkpoint_key, request.prompt, request.num_samples, request.options, True)
        for g, w in zip(got.sequences, want.sequences):
            assert g.tokens == w.tokens
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        np.testing.assert_allclose(got.prompt_logprobs, want.prompt_logprobs, atol=1e-5)
    # the adapters really differ from each other and from the base model
    assert len({tuple(b.sequences[0].tokens) for b in batched[:4]}) == 4


def test_prompt_logprobs_match_a_direct_computation(backend):
    prompt = np.array([4, 8, 15, 16, 23, 42], dtype=np.int32)
    got = backend.compute_logprobs("y", prompt)
    with torch.no_grad(), backend.lora.route([("y", None)]):
        logits = backend.loaded.model(input_ids=torch.tensor(prompt[None], dtype=torch.long)).logits[0]
    want = logits.log_softmax(-1)[torch.arange(5), torch.tensor(prompt[1:], dtype=torch.long)].numpy()
    assert np.isnan(got[0])
    np.testing.assert_allclose(got[1:], want, atol=1e-6)


def test_seed_reproducibility_top_k_and_stop_tokens(backend):
    prompt = np.array([5, 6, 7], dtype=np.int32)
    opts = SamplingOptions(max_tokens=12, temperature=1.0, seed=1234, stop_disabled=True)
    a = backend.sample("x", prompt, 3, opts, False)
    b = backend.sample("x", prompt, 3, opts, False)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # num_samples gives distinct sequences
    top1 = backend.sample("x", prompt, 2, SamplingOptions(max_tokens=6, temperature=1.0, top_k=1, seed=3, stop_disabled=True), False)
    greedy = backend.sample("x", prompt, 1, SamplingOptions(max_tokens=6, temperature=0.0, stop_disabled=True), False)
    assert top1.sequences[0].tokens == top1.sequences[1].tokens == greedy.sequences[0].tokens
    stop_at = greedy.sequences[0].tokens[2]
    stopped = backend.sample("x", prompt, 1, SamplingOptions(max_tokens=6, temperature=0.0, stop_token_ids=(stop_at,)), False)
    first = greedy.sequences[0].tokens.index(stop_at)
    assert stopped.sequences[0].tokens == greedy.sequences[0].tokens[: first + 1]
    assert stopped.sequences[0].stop_reason == "stop" and greedy.sequences[0].stop_reason == "length"


def test_unknown_adapter_and_bad_prompt(backend):
    with pytest.raises(AdapterNotLoaded, match="^ADAPTER_NOT_LOADED: checkpoint nope is not loaded"):
        backend.sample("nope", np.array([1, 2], dtype=np.int32), 1, GREEDY, False)
    with pytest.raises(AdapterNotLoaded):
        backend.drop_adapter("nope")
    with pytest.raises(InvalidArgument):
        backend.compute_logprobs(None, np.array([1, 99999], dtype=np.int32))


def test_top_k_logprobs_and_the_logprob_mode(backend):
    prompt = np.array([9, 10, 11], dtype=np.int32)
    [result] = backend.sample_batch([SampleRequest("z", prompt, 1, GREEDY, topk_logprobs=3)])
    seq = result.sequences[0]
    assert len(seq.topk_ids) == len(seq.tokens) == 8
    for token, lp, ids, lps in zip(seq.tokens, seq.logprobs, seq.topk_ids, seq.topk_logprobs):
        assert ids[0] == token and lps[0] == pytest.approx(lp, abs=1e-6)  # greedy picks the top-1
        assert lps == sorted(lps, reverse=True)
    # processed logprobs: under the distribution actually sampled from
    greedy_processed = backend.sample("z", prompt, 1, SamplingOptions(max_tokens=4, temperature=0.0, stop_disabled=True,
                                                                      processed_logprobs=True), False)
    assert greedy_processed.sequences[0].logprobs == [0.0] * 4
    hot = SamplingOptions(max_tokens=4, temperature=0.5, seed=5, stop_disabled=True)
    raw = backend.sample("z", prompt, 1, hot, False).sequences[0]
    processed = backend.sample("z", prompt, 1, SamplingOptions(**{**hot.__dict__, "processed_logprobs": True}), False).sequences[0]
    assert raw.tokens == processed.tokens
    with torch.no_grad(), backend.lora.route([("z", None)]):
        logits = backend.loaded.model(input_ids=torch.tensor([list(prompt) + raw.tokens])).logits[0]
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(raw.tokens))
    targets = torch.tensor(raw.tokens)
    want_raw = logits.log_softmax(-1)[positions, targets].numpy()
    want_processed = (logits / 0.5).log_softmax(-1)[positions, targets].numpy()
    np.testing.assert_allclose(raw.logprobs, want_raw, atol=1e-4)
    np.testing.assert_allclose(processed.logprobs, want_processed, atol=1e-4)


def test_sampling_params_convert_and_are_checked():
    params = types_pb2.SamplingParams(max_tokens=5, seed=3, temperature=0.5, top_k=-1, top_p=1.0, stop_strings=["\n"],
                                      stop_token_ids=encode_tokens([7, 9]))
    assert convert.sampling_options_from_pb(params, 512) == SamplingOptions(
        max_tokens=5, seed=3, temperature=0.5, top_k=0, top_p=1.0, stop_strings=("\n",), stop_token_ids=(7, 9))
    assert convert.sampling_options_from_pb(types_pb2.SamplingParams(max_tokens=1), 512).seed is None
    for bad, match in [(dict(max_tokens=0), "max_tokens"), (dict(max_tokens=1, temperature=-1), "temperature"),
                       (dict(max_tokens=1, top_p=1.5), "top_p"), (dict(max_tokens=1, stop_token_ids=encode_tokens([512])), "stop")]:
        with pytest.raises(InvalidArgument, match=match):
            convert.sampling_options_from_pb(types_pb2.SamplingParams(**bad), 512)


def test_sample_through_the_servicer_converts_and_counts(backend, tmp_path):
    from prometheus_client import REGISTRY

    def value(name):
        return REGISTRY.get_sample_value(name) or 0.0

    names = ["temper_sampler_tokens_sampled_total", "temper_sampler_batch_sequences_count", "temper_sampler_batch_sequences_sum",
             "temper_sampler_sample_seconds_count"]
    before = {n: value(n) for n in names}
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4)
    prompt = [9, 10, 11]
    request = sampler_pb2.SamplerSampleRequest(
        checkpoint_key="z", prompt_tokens=encode_tokens(prompt), num_samples=2, include_prompt_logprobs=True, topk_logprobs=2,
        sampling_params=types_pb2.SamplingParams(max_tokens=6, temperature=0.0, stop_disabled=True))
    response = asyncio.run(servicer.Sample(request, None))
    want = backend.sample_batch([SampleRequest("z", np.array(prompt, np.int32), 2, GREEDY, True, 2)])[0]
    assert len(response.sequences) == 2
    for seq, expected in zip(response.sequences, want.sequences):
        assert decode_tokens(seq.tokens).tolist() == expected.tokens[:6] and seq.stop_reason == types_pb2.STOP_REASON_LENGTH
        np.testing.assert_allclose(decode_floats(seq.logprobs), expected.logprobs[:6], atol=1e-5)
        assert seq.topk == 2 and decode_tokens(seq.topk_token_ids).reshape(-1, 2)[:, 0].tolist() == expected.tokens[:6]
    np.testing.assert_allclose(decode_array(response.prompt_logprobs), want.prompt_logprobs, atol=1e-6, equal_nan=True)
    moved = {n: value(n) - before[n] for n in names}
    assert moved["temper_sampler_tokens_sampled_total"] == 12  # 2 sequences x 6 tokens
    assert moved["temper_sampler_batch_sequences_count"] == 1 and moved["temper_sampler_batch_sequences_sum"] == 2
    assert moved["temper_sampler_sample_seconds_count"] == 1
    with pytest.raises(InvalidArgument, match="num_samples"):
        asyncio.run(servicer.Sample(sampler_pb2.SamplerSampleRequest(prompt_tokens=encode_tokens(prompt), num_samples=5,
                                                                     sampling_params=request.sampling_params), None))
    info = asyncio.run(servicer.GetModelInfo(None, None))
    assert list(info.loaded_adapters) == ["x", "y", "z"] and info.backend == "torch"
