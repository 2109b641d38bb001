"""The torch sampler on the tiny vision-language models (qwen3_vl, qwen3_vl_moe): greedy samples, prompt
logprobs (top-k and last_n included) and compute_logprobs on image prompts equal a direct forward of the
model (pixel_values from its image processor, positions computed by the model itself, log_softmax, no
cache: one forward of the prompt and the sampled tokens checks every greedy step), with and without a
LoRA adapter; image and text prompts share a batch; no rotary state passes from one request to the next;
bad input is refused by name."""

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_tokens
from temper.common.errors import FailedPrecondition, InvalidArgument
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models import images as image_path
from temper.services.models.loading import load_model
from temper.services.sampler import convert
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, types_pb2
from tests.fixtures_stack import png_bytes

FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
GREEDY = SamplingOptions(max_tokens=5, temperature=0.0, stop_disabled=True)
TOL = 1e-5


def adapted_backend(folder, adapter_dir) -> TorchSamplerBackend:
    """A torch sampler on ``folder`` with adapter "a" (attention + MLP, random factors) loaded from a peft
    folder written to ``adapter_dir``."""
    backend = TorchSamplerBackend(load_model(folder))
    scratch = LoraModel(load_model(folder).model, folder)  # the adapter travels as a peft folder, as pushed
    scratch.add("a", AdapterSpec(rank=4, alpha=8, targets=scratch.group_targets(attn=True, mlp=True)), seed=0)
    with torch.no_grad():
        for p in scratch.adapters["a"].params.values():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    scratch.save("a", adapter_dir)
    backend.load_adapter("a", adapter_dir)
    return backend


@pytest.fixture(scope="module", params=FAMILIES)
def backend(request, vl_model_dirs, tmp_path_factory):
    return adapted_backend(vl_model_dirs[request.param], tmp_path_factory.mktemp(f"adapter-{request.param}"))


def text(tokens) -> types_pb2.ModelInputChunk:
    return types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens)))


def image(data: bytes, fmt: str = "png", expected: int | None = None) -> types_pb2.ModelInputChunk:
    chunk = types_pb2.ImageChunk(data=data, format=fmt)
    if expected is not None:
        chunk.expected_tokens = expected
    return types_pb2.ModelInputChunk(image=chunk)


def vl_prompt(backend, *colors, sizes=None, seed=0) -> types_pb2.ModelInput:
    """Random text, then each image between <|vision_start|> and <|vision_end|>, then more text."""
    rng = np.random.default_rng(seed)
    tokens = backend.loaded.vision.tokens
    chunks = [text(rng.integers(3, 400, 4).tolist())]
    for n, color in enumerate(colors):
        size = sizes[n] if sizes else (64, 64)
        chunks += [text([tokens.start]), image(png_bytes(color, size)), text([tokens.end])]
    chunks.append(text(rng.integers(3, 400, 3).tolist()))
    return types_pb2.ModelInput(chunks=chunks)


def flat(backend, model_input):
    return image_path.flatten(model_input, backend.loaded.vision)


def direct_logits(backend, key, tokens, model_input) -> torch.Tensor:
    """(T, vocab) float logits of one unpadded row: the model's own forward with its image processor's
    pixel_values and the token types, computing its multimodal positions itself (no cache)."""
    vision, model = backend.loaded.vision, backend.loaded.model
    pictures = [Image.open(io.BytesIO(c.image.data)).convert("RGB") for c in model_input.chunks if c.HasField("image")]
    ids = torch.tensor(np.asarray(tokens, dtype=np.int64))[None]
    kwargs = {"mm_token_type_ids": (ids == vision.tokens.image).int()}
    if pictures:
        pixels = vision.processor(images=pictures, return_tensors="pt")
        kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    with torch.no_grad(), backend.lora.route([(key, None)]):
        return backend.loaded.model(input_ids=ids, **kwargs).logits[0].float()


def direct_greedy(backend, key, model_input, sampled):
    """The greedy choice and its logprob after each prefix of ``sampled`` (the continuation under test), and
    the prompt's logprobs, from one no-cache forward of the prompt followed by ``sampled``: a causal model's
    logits at a position depend only on the tokens before it, so where the choices equal ``sampled`` they are
    the greedy decode recomputed from scratch at every step, without a forward per step."""
    seq = list(flat(backend, model_input).tokens)
    n = len(seq)
    lp = direct_logits(backend, key, seq + list(sampled[:-1]), model_input).log_softmax(-1)
    choices = lp[n - 1:].argmax(-1)
    tokens = [int(t) for t in choices]
    logprobs = [float(lp[n - 1 + i, t]) for i, t in enumerate(tokens)]
    return tokens, logprobs, lp[:n - 1], np.asarray(seq)


def check_batch_equals_direct_forward(backend, inputs):
    """``inputs``: (model input, adapter key, samples) prompts sampled in one greedy batch: greedy tokens,
    their logprobs, prompt logprobs and top-k prompt logprobs equal ``direct_greedy``. Returns the
    requests and their results."""
    requests = []
    for model_input, key, samples in inputs:
        f = flat(backend, model_input)
        requests.append(SampleRequest(key, f.tokens, samples, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=3,
                                      images=f.images))
    results = backend.sample_batch(requests)
    for (model_input, key, _), request, result in zip(inputs, requests, results):
        tokens, logprobs, prompt_lp, prompt = direct_greedy(backend, key, model_input, result.sequences[0].tokens)
        np.testing.assert_array_equal(prompt, request.prompt)
        assert len(tokens) == GREEDY.max_tokens
        for seq in result.sequences:
            assert seq.tokens == tokens
            np.testing.assert_allclose(seq.logprobs, logprobs, atol=TOL)
        want = prompt_lp.gather(-1, torch.tensor(prompt[1:], dtype=torch.long)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(result.prompt_logprobs[1:], want, atol=TOL)
        top = prompt_lp.topk(3, dim=-1)
        np.testing.assert_array_equal(result.topk_prompt_ids[1:], top.indices.numpy())
        np.testing.assert_allclose(result.topk_prompt_logprobs[1:], top.values.numpy(), atol=TOL)
    # the images and the adapter matter: the prompts do not all decode alike
    assert len({tuple(r.sequences[0].tokens) for r in results}) > 1
    return requests, results


def check_compute_logprobs(backend, key, model_input, f):
    """compute_logprobs of ``f`` (``model_input`` flattened), all and the last 6, equal a direct forward;
    returns the last 6's."""
    got = backend.compute_logprobs(key, f.tokens, images=f.images)
    lp = direct_logits(backend, key, f.tokens, model_input).log_softmax(-1)
    want = lp[:-1].gather(-1, torch.tensor(f.tokens[1:], dtype=torch.long)[:, None])[:, 0].numpy()
    assert got.shape == (len(f.tokens),) and np.isnan(got[0])
    np.testing.assert_allclose(got[1:], want, atol=TOL)
    last = backend.compute_logprobs(key, f.tokens, last_n=6, images=f.images)
    assert np.isnan(last[:-6]).all()
    np.testing.assert_allclose(last[-6:], want[-6:], atol=TOL)
    return last


def test_model_info_reports_the_vision_processor(backend, tiny_model_dir, tmp_path):
    info = convert.model_info_to_pb(backend.describe(), backend.name)
    assert info.HasField("vision") and info.vision.image_token_id == backend.loaded.model.config.image_token_id
    assert info.vision.image_processor_json == backend.loaded.vision.processor_json
    text_only = convert.model_info_to_pb(TorchSamplerBackend(load_model(tiny_model_dir)).describe(), "torch")
    assert not text_only.HasField("vision")


def test_mixed_batch_equals_a_direct_forward(backend):
    """Image prompts (one and two images, with the adapter and without) and a text prompt in one batch:
    greedy tokens, their logprobs, prompt logprobs (one per flattened token) and top-k prompt logprobs."""
    inputs = [(vl_prompt(backend, "red", seed=1), "a", 2), (vl_prompt(backend, "blue", "yellow", sizes=[(64, 64), (96, 64)],
                                                                     seed=2), None, 1),
              (types_pb2.ModelInput(chunks=[text([5, 17, 99, 140, 7])]), "a", 1), (vl_prompt(backend, "green", seed=3), None, 1)]
    requests, results = check_batch_equals_direct_forward(backend, inputs)
    for request, result in zip(requests, results):  # one prompt logprob (and top-k row) per flattened token
        assert result.prompt_logprobs.shape == (len(request.prompt),) and np.isnan(result.prompt_logprobs[0])
        assert result.topk_prompt_ids.shape == (len(request.prompt), 3)


def test_compute_logprobs_and_last_n_equal_a_direct_forward(backend):
    model_input = vl_prompt(backend, "purple", "orange", seed=4)
    f = flat(backend, model_input)
    for key in (None, "a"):
        last = check_compute_logprobs(backend, key, model_input, f)
        [sampled] = backend.sample_batch([SampleRequest(key, f.tokens, 1, GREEDY, prompt_logprobs=True,
                                                        prompt_logprobs_last_n=6, images=f.images)])
        np.testing.assert_allclose(sampled.prompt_logprobs, last, atol=TOL, equal_nan=True)


def test_images_that_differ_only_in_bytes_never_share_features(backend):
    red, blue = (flat(backend, vl_prompt(backend, color, seed=5)) for color in ("red", "blue"))
    np.testing.assert_array_equal(red.tokens, blue.tokens)  # the same tokens: only the image bytes differ
    together = backend.sample_batch([SampleRequest(None, f.tokens, 1, GREEDY, prompt_logprobs=True, images=f.images)
                                     for f in (red, blue)])
    for f, result in zip((red, blue), together):
        alone = backend.compute_logprobs(None, f.tokens, images=f.images)
        np.testing.assert_allclose(result.prompt_logprobs, alone, atol=TOL, equal_nan=True)
    after_image = slice(red.images[0].offset + red.images[0].tokens, None)
    assert not np.allclose(together[0].prompt_logprobs[after_image], together[1].prompt_logprobs[after_image], atol=1e-3)


def test_no_rotary_state_leaks_between_requests(backend):
    prompt = np.array([11, 42, 7, 300, 12, 5], dtype=np.int32)
    alone = backend.sample_batch([SampleRequest("a", prompt, 1, GREEDY, prompt_logprobs=True)])[0]
    f = flat(backend, vl_prompt(backend, "red", "blue", sizes=[(128, 64), (64, 64)], seed=6))
    backend.sample_batch([SampleRequest("a", f.tokens, 1, GREEDY, images=f.images)])
    after_image = backend.sample_batch([SampleRequest("a", prompt, 1, GREEDY, prompt_logprobs=True)])[0]
    inner = backend.loaded.model.model
    inner.rope_deltas = torch.tensor([[37]])  # what a cached-position forward would leave behind
    try:
        after_stale = backend.sample_batch([SampleRequest("a", prompt, 1, GREEDY, prompt_logprobs=True)])[0]
    finally:
        inner.rope_deltas = None
    for other in (after_image, after_stale):
        assert other.sequences[0].tokens == alone.sequences[0].tokens
        np.testing.assert_array_equal(other.sequences[0].logprobs, alone.sequences[0].logprobs)
        np.testing.assert_array_equal(other.prompt_logprobs, alone.prompt_logprobs)
    tokens, logprobs, _, _ = direct_greedy(backend, "a", types_pb2.ModelInput(chunks=[text(prompt.tolist())]),
                                           alone.sequences[0].tokens)
    assert alone.sequences[0].tokens == tokens
    np.testing.assert_allclose(alone.sequences[0].logprobs, logprobs, atol=TOL)


def _sample_request(prompt: types_pb2.ModelInput, tokens) -> sampler_pb2.SamplerSampleRequest:
    return sampler_pb2.SamplerSampleRequest(prompt_tokens=encode_tokens(tokens), prompt=prompt, num_samples=1,
                                            include_prompt_logprobs=True,
                                            sampling_params=types_pb2.SamplingParams(max_tokens=3, temperature=0.0,
                                                                                     stop_disabled=True))


def test_through_the_servicer(backend, tmp_path):
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4)
    model_input = vl_prompt(backend, "cyan", seed=7)
    f = flat(backend, model_input)
    response = asyncio.run(servicer.Sample(_sample_request(model_input, f.tokens.tolist()), None))
    want = backend.sample_batch([SampleRequest(None, f.tokens, 1, SamplingOptions(max_tokens=3, temperature=0.0,
                                                                                  stop_disabled=True),
                                               prompt_logprobs=True, images=f.images)])[0]
    assert decode_tokens(response.sequences[0].tokens).tolist() == want.sequences[0].tokens
    np.testing.assert_allclose(decode_floats(response.sequences[0].logprobs), want.sequences[0].logprobs, atol=TOL)
    np.testing.assert_allclose(decode_array(response.prompt_logprobs), want.prompt_logprobs, atol=TOL, equal_nan=True)
    scored = asyncio.run(servicer.ComputeLogprobs(sampler_pb2.SamplerLogprobsRequest(
        prompt_tokens=encode_tokens(f.tokens), prompt=model_input, prompt_logprobs_last_n=4), None))
    np.testing.assert_allclose(decode_array(scored.logprobs), backend.compute_logprobs(None, f.tokens, 4, images=f.images),
                               atol=TOL, equal_nan=True)


def test_bad_input_is_refused_by_name(backend, tiny_model_dir, tmp_path):
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4)
    tokens = backend.loaded.vision.tokens
    loaded_before = backend.describe().loaded_checkpoints

    def refused(model_input, flat_tokens=None, error=InvalidArgument, match=None):
        if flat_tokens is None:
            flat_tokens = flat(backend, model_input).tokens.tolist()
        with pytest.raises(error, match=match):
            asyncio.run(servicer.Sample(_sample_request(model_input, flat_tokens), None))

    n = backend.loaded.vision.count(64, 64)
    good = types_pb2.ModelInput(chunks=[text([5, tokens.start]), image(png_bytes("red"), expected=n), text([tokens.end])])
    refused(types_pb2.ModelInput(chunks=[text([5]), image(png_bytes("red"), expected=n + 1)]), [5] + [tokens.image] * n,
            match=f"expected_tokens is {n + 1} but the model's image processor makes {n}")
    refused(types_pb2.ModelInput(chunks=[text([5]), image(png_bytes("red")[:40], expected=n)]), [5] + [tokens.image] * n,
            match="corrupt PNG")
    refused(types_pb2.ModelInput(chunks=[text([5]), image(png_bytes("red"), fmt="gif", expected=n)]),
            [5] + [tokens.image] * n, match="format")
    refused(good, [5, tokens.start] + [tokens.image] * n, match=r"prompt_tokens \(\d+ tokens\) are not the prompt flattened")
    refused(good, [6, tokens.start] + [tokens.image] * n + [tokens.end], match="are not the prompt flattened")
    pointer = types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(image_asset_pointer=types_pb2.ImageAssetPointerChunk(
        location="temper-image://" + "0" * 64, format="png", expected_tokens=n))])
    refused(pointer, [tokens.image] * n, match="image_asset_pointer")
    # image tokens typed into prompt_tokens with no image: refused before the model sees them
    with pytest.raises(InvalidArgument, match="appears where no image is"):
        asyncio.run(servicer.Sample(sampler_pb2.SamplerSampleRequest(
            prompt_tokens=encode_tokens([5] + [tokens.image] * n), num_samples=1,
            sampling_params=types_pb2.SamplingParams(max_tokens=2)), None))
    with pytest.raises(InvalidArgument, match="appears where no image is"):
        backend.compute_logprobs(None, np.array([5] + [tokens.image] * n, dtype=np.int32))
    # deterministic mode is refused for the vision-language families, naming the family
    family = backend.loaded.model.config.model_type
    deterministic = _sample_request(good, flat(backend, good).tokens.tolist())
    deterministic.deterministic = True
    with pytest.raises(FailedPrecondition, match=f"vision-language family {family}"):
        asyncio.run(servicer.Sample(deterministic, None))
    with pytest.raises(FailedPrecondition, match=f"vision-language family {family}"):
        backend.compute_logprobs(None, np.array([5, 6], dtype=np.int32), deterministic=True)
    assert backend.describe().loaded_checkpoints == loaded_before
    # an image sent to a text-only base model
    text_backend = TorchSamplerBackend(load_model(tiny_model_dir))
    text_servicer = SamplerServicer(text_backend, tmp_path / "text", max_num_samples=4)
    with pytest.raises(InvalidArgument, match="takes text only; images need a vision-language base model"):
        asyncio.run(text_servicer.Sample(_sample_request(good, [5] + [1] * (n + 2)), None))
    with pytest.raises(InvalidArgument, match="takes text only"):
        text_backend.compute_logprobs(None, np.array([5, 6], dtype=np.int32), images=flat(backend, good).images)
