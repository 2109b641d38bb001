"""An exact attribution guard for in-flight weights (docs/async_rl.md), in float64: the tiny model and the
LoRA math in float64, so the KV-cached decode and a one-pass scoring agree to float64 rounding (in float32
they differ by up to ~6e-3 at rare positions, b5cc42f) and any routing or version mistake shows.

The sampler's logprobs leave it as float32 (the decode and the scoring take ``log_softmax`` of the logits cast
to float32, and the wire is float32), so "exact" here is: each sampled logprob is bit for bit a by-hand
float64 cached decode whose logits go through the same float32 ``log_softmax``, within float32 rounding of
that decode's pure float64 logprob, and, where a sequence is one version, bit for bit (within 1e-10)
``ComputeLogprobs`` on that version. A switch one step early or late differs by far more.

The decode is held at chosen steps with the sampler test's ``Gate`` (tests/engine/test_inflight_sampler.py)."""

import asyncio
import threading

import numpy as np
import pytest
import torch

from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_tokens
from temper.services.lora.layer import Router
from temper.services.lora.model import LoraModel
from temper.services.models.loading import load_model
from temper.services.sampler.backend import VersionSpan
from temper.services.sampler.convert import spans_from_pb
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2
from tests.engine.conftest import random_adapter_folders
from tests.engine.test_inflight_sampler import (
    MAX, PROMPT, SPECS, WAIT, Gate, held_switch, push, sample_request, set_target, streamed, until, v)

F32_ROUNDING = 2.0 ** -23   # relative: a float32 logprob vs the float64 one it rounds


@pytest.fixture(scope="module", autouse=True)
def float64_lora_math():
    """Router.compute_dtype runs LoRA math in float32 for any non-half activations; in float64 here."""
    original = Router.compute_dtype
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Router, "compute_dtype",
                      lambda self, x: torch.float64 if x.dtype == torch.float64 else original(self, x))
        yield


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    return random_adapter_folders(tiny_model_dir, tmp_path_factory, SPECS, scale=0.4, seed=40)


@pytest.fixture(scope="module")
def by_hand64(tiny_model_dir, folders):
    """Greedy float64 decode of PROMPT with plain transformers + LoRA, ``keys[j]`` the adapter whose forward
    computes token j's logits. Returns (tokens, the sampler's float32 logprobs of them, float64 logprobs)."""
    loaded = load_model(tiny_model_dir, dtype="float64")
    lora = LoraModel(loaded.model, tiny_model_dir)
    for key, folder in folders.items():
        spec, weights = LoraModel.read(folder)
        lora.add(key, spec)
        lora.load_weights(key, weights)

    @torch.no_grad()
    def decode(keys: list[str]) -> tuple[list[int], np.ndarray, np.ndarray]:
        with lora.route([(keys[0], None)]):
            out = loaded.model(input_ids=torch.tensor([PROMPT]), use_cache=True)
        tokens, lp32, lp64 = [], [], []
        for j in range(len(keys)):
            logits = out.logits[0, -1]
            assert logits.dtype == torch.float64
            tokens.append(int(logits.argmax()))
            lp32.append(float(logits.float().log_softmax(-1)[tokens[-1]]))
            lp64.append(float(logits.log_softmax(-1)[tokens[-1]]))
            if j + 1 < len(keys):
                with lora.route([(keys[j + 1], None)]):
                    out = loaded.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                                       use_cache=True)
        return tokens, np.array(lp32, np.float32), np.array(lp64)

    return decode


@pytest.fixture
def servicer(tiny_model_dir, tmp_path):
    loaded = load_model(tiny_model_dir, dtype="float64")
    return SamplerServicer(TorchSamplerBackend(loaded), tmp_path, max_num_samples=4)


async def scored(servicer, key: str, tokens: list[int]) -> np.ndarray:
    """ComputeLogprobs of PROMPT + tokens on adapter ``key``: the sampled positions' logprobs in one pass."""
    request = sampler_pb2.SamplerLogprobsRequest(checkpoint_key=key, prompt_tokens=encode_tokens(PROMPT + tokens),
                                                 prompt_logprobs_last_n=len(tokens))
    return decode_array((await servicer.ComputeLogprobs(request, None)).logprobs)[-len(tokens):]


def assert_exact(logprobs, want: tuple[list[int], np.ndarray, np.ndarray]) -> None:
    _, lp32, lp64 = want
    np.testing.assert_array_equal(np.asarray(logprobs, np.float32), lp32)
    np.testing.assert_allclose(np.asarray(logprobs, np.float64), lp64, rtol=2 * F32_ROUNDING, atol=1e-12)


def assert_differs(logprobs, want, by: float = 1e-4) -> None:
    assert np.max(np.abs(np.asarray(logprobs, np.float64) - want[2])) > by


async def held_request(servicer, folders, request_factory):
    """Start a request on A (target v1), push B and make it the target (v2) while forward 4 is held."""
    released = threading.Event()
    await push(servicer, "A", folders["A"])
    assert await set_target(servicer, "A", 1) == 1
    gate = Gate(servicer.backend.loaded.model, held_switch(servicer, released))
    try:
        task = asyncio.create_task(request_factory())
        await until(gate.reached[3].is_set)
        await asyncio.wait_for(push(servicer, "B", folders["B"]), WAIT)
        await until(gate.reached[4].is_set)
        assert not task.done() and await set_target(servicer, "B", 2) == 2
        released.set()
        result = await task
    finally:
        gate.close()
    assert gate.timed_out == []
    return result


def test_a_following_request_crossing_an_update_is_exactly_its_attributed_versions(servicer, folders, by_hand64):
    async def scenario():
        tokens, logprobs, spans = await held_request(servicer, folders,
                                                     lambda: streamed(servicer, sample_request("A", 1)))
        assert spans == [VersionSpan(v(1), 0, 5), VersionSpan(v(2), 5, MAX - 5)]
        want = by_hand64(["A"] * 5 + ["B"] * (MAX - 5))
        assert tokens == want[0]
        assert_exact(logprobs, want)
        for wrong in (["A"] * 4 + ["B"] * (MAX - 4), ["A"] * 6 + ["B"] * (MAX - 6), ["A"] * MAX, ["B"] * MAX):
            assert_differs(logprobs, by_hand64(wrong))   # a switch a step off, or none, would show
        # the first span is version 1 alone: ComputeLogprobs on A scores it to the bit
        np.testing.assert_allclose(await scored(servicer, "A", tokens[:5]), logprobs[:5], rtol=0, atol=1e-10)

    asyncio.run(scenario())


def test_a_pinned_request_is_exactly_its_version_and_its_scoring(servicer, folders, by_hand64):
    async def scenario():
        response = await held_request(servicer, folders,
                                      lambda: servicer.Sample(sample_request("A", 1, pin=True), None))
        (seq,) = response.sequences
        assert spans_from_pb(seq.versions) == [VersionSpan(v(1), 0, MAX)]
        tokens, logprobs = decode_tokens(seq.tokens).tolist(), decode_floats(seq.logprobs)
        want = by_hand64(["A"] * MAX)
        assert tokens == want[0]
        assert_exact(logprobs, want)
        assert_differs(logprobs, by_hand64(["A"] * 5 + ["B"] * (MAX - 5)))
        np.testing.assert_allclose(await scored(servicer, "A", tokens), logprobs, rtol=0, atol=1e-10)
        assert np.max(np.abs(await scored(servicer, "B", tokens) - logprobs)) > 1e-4   # the other version differs
        assert servicer.residency.pins("A") == 0 and servicer.residency.pins("B") == 0

    asyncio.run(scenario())
