"""The sampler keeps a bounded set of adapters, through the servicer without a server: the least
recently used one goes, the others answer exactly as before, an evicted one answers "not loaded"
(FAILED_PRECONDITION, "ADAPTER_NOT_LOADED: ...") and, pushed again, answers exactly as before its
eviction; an adapter a queued request uses is never evicted; the byte bound."""

import asyncio
import threading

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from temper.common.checkpoints import WEIGHT_FILES
from temper.common.codec import decode_array, encode_tokens
from temper.common.errors import AdapterNotLoaded, InvalidArgument
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import load_model
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, types_pb2
from tests.engine.conftest import random_adapter_folders

SPECS = {   # smallest to largest adapter files
    "a": AdapterSpec(rank=2, alpha=4, targets=("q_proj", "v_proj")),
    "b": AdapterSpec(rank=4, alpha=8, targets=("gate_proj", "up_proj")),
    "c": AdapterSpec(rank=8, alpha=16, targets=("down_proj", "k_proj", "o_proj", "q_proj")),
}
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    return random_adapter_folders(tiny_model_dir, tmp_path_factory, SPECS, scale=0.3, seed=10)


@pytest.fixture
def backend(tiny_model_dir):
    return TorchSamplerBackend(load_model(tiny_model_dir))


def size(folder) -> int:
    return sum((folder / name).stat().st_size for name in WEIGHT_FILES)


async def push(servicer: SamplerServicer, key: str, folder) -> None:
    async def chunks():
        yield sampler_pb2.PushAdapterChunk(checkpoint_key=key)
        for name in WEIGHT_FILES:
            data = (folder / name).read_bytes()
            yield sampler_pb2.PushAdapterChunk(file=types_pb2.FileChunk(relative_path=name, data=data, total_size=len(data)))

    response = await servicer.PushAdapter(chunks(), None)
    assert response.bytes_received == size(folder)


def sample(key: str) -> sampler_pb2.SamplerSampleRequest:
    return sampler_pb2.SamplerSampleRequest(
        checkpoint_key=key, prompt_tokens=encode_tokens(PROMPT), num_samples=2, include_prompt_logprobs=True, topk_logprobs=2,
        sampling_params=types_pb2.SamplingParams(max_tokens=6, temperature=1.0, seed=1234, stop_disabled=True))


def logprobs(key: str) -> sampler_pb2.SamplerLogprobsRequest:
    return sampler_pb2.SamplerLogprobsRequest(checkpoint_key=key, prompt_tokens=encode_tokens(PROMPT))


def direct_logprobs(model_dir: str, folder) -> np.ndarray:
    """log p(prompt[i] | prompt[:i]) from a fresh copy of the model with the adapter's files."""
    loaded = load_model(model_dir)
    lora = LoraModel(loaded.model, model_dir)
    spec, weights = LoraModel.read(folder)
    lora.add("k", spec)
    lora.load_weights("k", weights)
    with torch.no_grad(), lora.route([("k", None)]):
        logits = loaded.model(input_ids=torch.tensor([PROMPT])).logits[0]
    return logits.log_softmax(-1)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].numpy()


def metric(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_the_least_recently_used_adapter_is_evicted_and_comes_back_identical(backend, folders, tiny_model_dir, tmp_path):
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4, max_adapters=2)
    evictions = metric("temper_sampler_adapter_evictions_total")

    async def scenario():
        await push(servicer, "a", folders["a"])
        await push(servicer, "b", folders["b"])
        b_sampled = await servicer.Sample(sample("b"), None)
        b_logprobs = await servicer.ComputeLogprobs(logprobs("b"), None)
        a_sampled = await servicer.Sample(sample("a"), None)   # a, loaded first, is now used last
        base = await servicer.Sample(sample(""), None)
        assert len({r.sequences[0].logprobs for r in (a_sampled, b_sampled, base)}) == 3  # they really differ

        await push(servicer, "c", folders["c"])
        assert servicer.residency.keys() == ["a", "c"]
        assert list((await servicer.GetModelInfo(None, None)).loaded_adapters) == ["a", "c"]
        assert metric("temper_sampler_adapter_evictions_total") == evictions + 1
        assert metric("temper_sampler_resident_adapters") == 2
        assert await servicer.Sample(sample("a"), None) == a_sampled   # exactly as before
        assert await servicer.Sample(sample(""), None) == base
        for call in (servicer.Sample(sample("b"), None), servicer.ComputeLogprobs(logprobs("b"), None)):
            with pytest.raises(AdapterNotLoaded) as raised:
                await call
            assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert raised.value.message == "ADAPTER_NOT_LOADED: checkpoint b is not loaded on this sampler"

        await push(servicer, "b", folders["b"])   # c was used less recently than a
        assert servicer.residency.keys() == ["a", "b"] and metric("temper_sampler_adapter_evictions_total") == evictions + 2
        assert await servicer.Sample(sample("b"), None) == b_sampled   # same seed: same tokens, same logprobs
        again = await servicer.ComputeLogprobs(logprobs("b"), None)
        assert again == b_logprobs
        got = decode_array(again.logprobs)
        assert np.isnan(got[0])
        np.testing.assert_allclose(got[1:], direct_logprobs(tiny_model_dir, folders["b"]), atol=1e-6)

    asyncio.run(scenario())


def test_an_adapter_a_queued_request_uses_is_not_evicted(backend, folders, tmp_path):
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4, max_adapters=2)
    gate = threading.Event()
    submitted = []
    run = servicer._run

    async def recording_run(fn, *args):  # what reaches the compute thread, in order
        submitted.append(fn.__name__)
        return await run(fn, *args)

    async def until(condition):
        while not condition():
            await asyncio.sleep(0)

    async def scenario():
        await push(servicer, "a", folders["a"])
        await push(servicer, "b", folders["b"])
        a_sampled = await servicer.Sample(sample("a"), None)
        servicer._run = recording_run
        blocker = asyncio.get_running_loop().run_in_executor(servicer._compute, gate.wait)
        first = asyncio.create_task(servicer.Sample(sample(""), None))   # decodes first (once the gate opens)
        await until(lambda: "sample_batch" in submitted)
        queued = asyncio.create_task(servicer.Sample(sample("a"), None))  # waits for the next batch, a pinned
        await until(lambda: servicer.residency.pins("a") == 1)
        servicer.residency.release(servicer.residency.use("b"))  # b used since (a request that just ended)
        assert servicer.residency.keys() == ["a", "b"]   # a is the least recently used, and in use
        pushing = asyncio.create_task(push(servicer, "c", folders["c"]))  # loads before that next batch
        await until(lambda: "_install" in submitted)
        gate.set()
        await asyncio.gather(blocker, first, pushing)
        assert await queued == a_sampled
        assert submitted == ["sample_batch", "_install", "sample_batch"]
        assert servicer.residency.keys() == ["a", "c"] and servicer.residency.pins("a") == 0  # b went, not a
        with pytest.raises(AdapterNotLoaded):
            await servicer.Sample(sample("b"), None)

    asyncio.run(scenario())


def test_a_drop_waits_for_the_requests_using_the_adapter(backend, folders, tmp_path):
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4, max_adapters=2)
    gate = threading.Event()

    async def scenario():
        await push(servicer, "a", folders["a"])
        a_sampled = await servicer.Sample(sample("a"), None)
        blocker = asyncio.get_running_loop().run_in_executor(servicer._compute, gate.wait)
        using = asyncio.create_task(servicer.Sample(sample("a"), None))
        while servicer.residency.pins("a") == 0:
            await asyncio.sleep(0)
        dropping = asyncio.create_task(servicer.DropAdapter(sampler_pb2.SamplerDropAdapterRequest(checkpoint_key="a"), None))
        await asyncio.sleep(0)
        with pytest.raises(AdapterNotLoaded):   # no new uses meanwhile
            await servicer.Sample(sample("a"), None)
        assert not dropping.done()
        gate.set()
        await blocker
        assert await using == a_sampled
        await dropping
        assert servicer.residency.keys() == [] and backend.describe().loaded_checkpoints == []
        with pytest.raises(AdapterNotLoaded):
            await servicer.DropAdapter(sampler_pb2.SamplerDropAdapterRequest(checkpoint_key="a"), None)

    asyncio.run(scenario())


def test_the_byte_bound(backend, folders, tmp_path):
    sizes = {key: size(folder) for key, folder in folders.items()}
    assert sizes["a"] < sizes["b"] < sizes["c"]
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4, max_adapters=10, max_adapter_bytes=sizes["b"] + sizes["c"])

    async def scenario():
        await push(servicer, "a", folders["a"])
        await push(servicer, "b", folders["b"])
        assert metric("temper_sampler_resident_adapter_bytes") == sizes["a"] + sizes["b"]
        await push(servicer, "c", folders["c"])   # a + b + c is over the bound; b + c is not
        assert servicer.residency.keys() == ["b", "c"] and backend.describe().loaded_checkpoints == ["b", "c"]
        assert metric("temper_sampler_resident_adapter_bytes") == sizes["b"] + sizes["c"]
        small = SamplerServicer(backend, tmp_path / "small", max_num_samples=4, max_adapter_bytes=sizes["a"] - 1)
        with pytest.raises(InvalidArgument, match=f"holds at most {sizes['a'] - 1}"):
            await push(small, "a", folders["a"])
        assert backend.describe().loaded_checkpoints == ["b", "c"]   # refused before anything was dropped

    asyncio.run(scenario())


def test_a_refused_push_evicts_nothing(backend, folders, tmp_path):
    """An adapter the backend cannot load (here: tensors of another shape than its config says) is
    refused before anything is evicted to make room for it."""
    import shutil
    from safetensors.torch import load_file, save_file

    servicer = SamplerServicer(backend, tmp_path, max_num_samples=4, max_adapters=2)
    bad = tmp_path / "bad"
    shutil.copytree(folders["c"], bad)
    weights = {name: t[:-1] if "lora_A" in name else t for name, t in load_file(str(bad / "adapter_model.safetensors")).items()}
    save_file(weights, str(bad / "adapter_model.safetensors"))

    async def scenario():
        await push(servicer, "a", folders["a"])
        await push(servicer, "b", folders["b"])
        before = await servicer.Sample(sample("a"), None)
        with pytest.raises(InvalidArgument):
            await push(servicer, "c", bad)
        assert sorted(servicer.residency.keys()) == ["a", "b"]
        assert sorted(backend.lora.adapters) == ["a", "b"]
        assert await servicer.Sample(sample("a"), None) == before

    asyncio.run(scenario())
