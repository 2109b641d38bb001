"""Top-k prompt logprobs and prompt_logprobs_last_n on the torch sampler: the ids and logprobs equal
torch.topk of log_softmax of the model's own logits (with an adapter, in a mixed batch, chunked or
not), only the last n positions are scored, and bad values are refused before anything runs."""

import asyncio

import numpy as np
import pytest
import torch

from temper.common.codec import decode_array, encode_tokens
from temper.common.errors import InvalidArgument
from temper.common.validation import MAX_TOPK_PROMPT_LOGPROBS, TOPK_MASK_LOGPROB
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import load_model
from temper.services.sampler import convert, torch_backend
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, types_pb2

GREEDY = SamplingOptions(max_tokens=3, temperature=0.0, stop_disabled=True)
PROMPT = np.array([4, 8, 15, 16, 23, 42, 7, 99], dtype=np.int32)


@pytest.fixture(scope="module")
def backend(tiny_model_dir, tmp_path_factory):
    backend = TorchSamplerBackend(load_model(tiny_model_dir))
    scratch = LoraModel(load_model(tiny_model_dir).model, tiny_model_dir)
    scratch.add("a", AdapterSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "lm_head")), seed=0)
    with torch.no_grad():
        for p in scratch.adapters["a"].params.values():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    folder = tmp_path_factory.mktemp("adapter-a")
    scratch.save("a", folder)
    backend.load_adapter("a", folder)
    return backend


def direct(backend, key, prompt, k):
    """log_softmax of the model's logits at positions 0..n-2 (predicting prompt[1:]): top-k and the prompt's own."""
    with torch.no_grad(), backend.lora.route([(key, None)]):
        logits = backend.loaded.model(input_ids=torch.tensor(prompt[None], dtype=torch.long)).logits[0]
    lp = logits[:-1].float().log_softmax(-1)
    top = torch.topk(lp, k, dim=-1)
    own = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    return top.indices.numpy(), top.values.numpy(), own.numpy()


@pytest.mark.parametrize("chunk", [512, 3])  # 3: scored in several chunks
def test_topk_prompt_logprobs_equal_torch_topk(backend, monkeypatch, chunk):
    monkeypatch.setattr(torch_backend, "PROMPT_CHUNK", chunk)
    k = 5
    other = np.array([3, 5, 7], dtype=np.int32)
    results = backend.sample_batch([  # mixed with other work: the rows are the request's own
        SampleRequest(None, other, 2, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=2),
        SampleRequest("a", PROMPT, 1, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=k),
    ])
    got = results[1]
    ids, lps, own = direct(backend, "a", PROMPT, k)
    assert got.topk_prompt_ids.shape == got.topk_prompt_logprobs.shape == (len(PROMPT), k)
    assert got.topk_prompt_ids.dtype == np.int32 and got.topk_prompt_logprobs.dtype == np.float32
    assert got.topk_prompt_ids[0].tolist() == [0] * k and got.topk_prompt_logprobs[0].tolist() == [TOPK_MASK_LOGPROB] * k
    np.testing.assert_array_equal(got.topk_prompt_ids[1:], ids)
    np.testing.assert_allclose(got.topk_prompt_logprobs[1:], lps, atol=1e-5)
    np.testing.assert_allclose(got.prompt_logprobs[1:], own, atol=1e-5)
    assert np.isnan(got.prompt_logprobs[0])
    base_ids, base_lps, _ = direct(backend, None, other, 2)
    np.testing.assert_array_equal(results[0].topk_prompt_ids[1:], base_ids)
    np.testing.assert_allclose(results[0].topk_prompt_logprobs[1:], base_lps, atol=1e-5)
    # top-k alone: no prompt logprobs asked for, none returned
    [alone] = backend.sample_batch([SampleRequest("a", PROMPT, 1, GREEDY, topk_prompt_logprobs=1)])
    assert alone.prompt_logprobs is None
    np.testing.assert_array_equal(alone.topk_prompt_ids[1:, 0], ids[:, 0])


def test_last_n_scores_only_the_last_positions(backend):
    k, n = 3, 3
    [got] = backend.sample_batch([SampleRequest("a", PROMPT, 1, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=k,
                                                prompt_logprobs_last_n=n)])
    ids, lps, own = direct(backend, "a", PROMPT, k)
    cut = len(PROMPT) - n
    assert np.isnan(got.prompt_logprobs[:cut]).all()
    np.testing.assert_allclose(got.prompt_logprobs[cut:], own[cut - 1:], atol=1e-5)
    assert (got.topk_prompt_ids[:cut] == 0).all() and (got.topk_prompt_logprobs[:cut] == TOPK_MASK_LOGPROB).all()
    np.testing.assert_array_equal(got.topk_prompt_ids[cut:], ids[cut - 1:])
    np.testing.assert_allclose(got.topk_prompt_logprobs[cut:], lps[cut - 1:], atol=1e-5)
    # the whole prompt (n = len - 1) equals no last_n at all; compute_logprobs honours it too
    [whole] = backend.sample_batch([SampleRequest("a", PROMPT, 1, GREEDY, prompt_logprobs=True, prompt_logprobs_last_n=len(PROMPT) - 1)])
    np.testing.assert_allclose(whole.prompt_logprobs[1:], own, atol=1e-5)
    scored = backend.compute_logprobs("a", PROMPT, last_n=2)
    assert np.isnan(scored[:-2]).all()
    np.testing.assert_allclose(scored[-2:], own[-2:], atol=1e-5)


def test_through_the_servicer_and_bad_values(backend, tmp_path):
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4)
    params = types_pb2.SamplingParams(max_tokens=2, temperature=0.0, stop_disabled=True)
    request = sampler_pb2.SamplerSampleRequest(checkpoint_key="a", prompt_tokens=encode_tokens(PROMPT.tolist()), num_samples=1,
                                               sampling_params=params, include_prompt_logprobs=True, topk_prompt_logprobs=4,
                                               prompt_logprobs_last_n=5)
    response = asyncio.run(servicer.Sample(request, None))
    ids, lps, _ = direct(backend, "a", PROMPT, 4)
    got_ids, got_lps = decode_array(response.topk_prompt_token_ids), decode_array(response.topk_prompt_logprobs)
    assert list(response.topk_prompt_token_ids.shape) == [len(PROMPT), 4] and response.topk_prompt_token_ids.dtype == types_pb2.DTYPE_INT32
    np.testing.assert_array_equal(got_ids[-5:], ids[-5:])
    np.testing.assert_allclose(got_lps[-5:], lps[-5:], atol=1e-5)
    assert np.isnan(decode_array(response.prompt_logprobs)[:-5]).all()
    plain = asyncio.run(servicer.Sample(sampler_pb2.SamplerSampleRequest(
        checkpoint_key="a", prompt_tokens=encode_tokens(PROMPT.tolist()), num_samples=1, sampling_params=params), None))
    assert not plain.HasField("topk_prompt_token_ids") and not plain.HasField("prompt_logprobs")

    bad = [(dict(topk_prompt_logprobs=MAX_TOPK_PROMPT_LOGPROBS + 1), "topk_prompt_logprobs"),
           (dict(topk_prompt_logprobs=-1), "topk_prompt_logprobs"),
           (dict(include_prompt_logprobs=True, prompt_logprobs_last_n=0), "prompt_logprobs_last_n"),
           (dict(include_prompt_logprobs=True, prompt_logprobs_last_n=len(PROMPT)), "prompt_logprobs_last_n"),
           (dict(prompt_logprobs_last_n=2), "needs include_prompt_logprobs")]
    for fields, match in bad:
        with pytest.raises(InvalidArgument, match=match):
            convert.sample_request_from_pb(sampler_pb2.SamplerSampleRequest(
                prompt_tokens=encode_tokens(PROMPT.tolist()), num_samples=1, sampling_params=params, **fields), 512, 4)
    with pytest.raises(InvalidArgument, match="prompt_logprobs_last_n"):
        backend.compute_logprobs("a", PROMPT, last_n=len(PROMPT))
