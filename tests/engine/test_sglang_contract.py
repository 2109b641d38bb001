"""The SGLang sampler backend against a fake ``sglang`` (tests/engine/sglang_fake.py: the calls we
make, shaped as in sglang 0.5.23, backed by the tiny model): it samples what the torch backend
samples, reports raw logprobs by default and processed ones on request, maps or refuses every
option by name, keeps one SGLang adapter per checkpoint version through load / use / evict / reload,
and turns SGLang's errors into Temper's statuses. sglang itself is never imported."""

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import sglang_fake
from temper.common.checkpoints import WEIGHT_FILES
from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_tokens
from temper.common.errors import AdapterNotLoaded, Internal, InvalidArgument, TemperError, Unavailable
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import load_model
from temper.services.sampler.backend import SampleRequest, SamplingOptions, VersionSpan, WeightsVersion
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.settings import SamplerConfigError, SamplerSettings
from temper.services.sampler.sglang_backend import (SGLangSamplerBackend, check_parallel, check_servable,
                                                     engine_kwargs)
from temper.services.sampler.sglang_requests import ModelFacts, check_options, derive_seed
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, types_pb2
from tests.engine.conftest import random_adapter_folders

SPECS = {
    "run1/sampler_weights/a": AdapterSpec(rank=2, alpha=4, targets=("q_proj", "v_proj")),
    "run2/sampler_weights/b": AdapterSpec(rank=8, alpha=8, targets=("gate_proj", "up_proj")),
    "run3/sampler_weights/c": AdapterSpec(rank=4, alpha=16, targets=("down_proj", "k_proj", "o_proj", "q_proj")),
}
A, B, C = SPECS
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, stop_disabled=True)


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    return random_adapter_folders(tiny_model_dir, tmp_path_factory, SPECS, scale=0.3, seed=20)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, folders):
    backend = TorchSamplerBackend(load_model(tiny_model_dir))
    for key, folder in folders.items():
        backend.load_adapter(key, folder)
    return backend


@pytest.fixture(scope="module")
def module_patch():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def make_backend(tiny_model_dir, patch, **overrides) -> SGLangSamplerBackend:
    sglang_fake.install(patch)
    patch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)  # the backend must set it itself
    settings = SamplerSettings(base_model=tiny_model_dir, backend="sglang", **overrides)
    return SGLangSamplerBackend(settings)


@pytest.fixture(scope="module")
def backend(tiny_model_dir, folders, module_patch):
    backend = make_backend(tiny_model_dir, module_patch)
    for key, folder in folders.items():
        backend.load_adapter(key, folder)
    yield backend
    backend.close()


def engine_of(backend) -> "sglang_fake.Engine":
    return backend._engine


def test_engine_is_started_for_multi_lora_and_raw_logprobs(backend):
    engine = engine_of(backend)
    args = engine.args
    assert args["enable_lora"] and args["max_loaded_loras"] is None and args["max_loras_per_batch"] == 8
    assert args["sampling_defaults"] == "openai" and args["enable_deterministic_inference"]
    assert args["tp_size"] == 1 and args["dp_size"] == 1  # the defaults: one GPU, one replica
    assert args["disable_shared_experts_fusion"] and not backend._shared_experts_fused  # shared-expert LoRA has a module
    assert engine.original_logprob, "SGLANG_RETURN_ORIGINAL_LOGPROB must be set before the engine starts"
    assert set(engine.adapters) == {f"{key}@{i + 1}" for i, key in enumerate(SPECS)}  # one name per version
    assert backend.describe().loaded_checkpoints == sorted(SPECS)


def test_greedy_mixed_adapter_batch_equals_the_torch_backend(backend, reference):
    rng = np.random.default_rng(0)
    requests = [SampleRequest(key, rng.integers(3, 500, n).astype(np.int32), samples, GREEDY, prompt_logprobs=True,
                              topk_logprobs=3, topk_prompt_logprobs=4)
                for key, n, samples in [(A, 5, 2), (None, 9, 1), (B, 3, 1), (C, 12, 2), (A, 7, 1)]]
    calls = len(engine_of(backend).generate_calls)
    got = backend.sample_batch(requests)
    assert len(engine_of(backend).generate_calls) == calls + 1, "one batch is one generate call"
    lora = engine_of(backend).generate_calls[-1].lora_path
    assert len({name for name in lora if name}) == 3 and None in lora  # many adapters (and the base) together
    want = reference.sample_batch(requests)
    for g, w in zip(got, want):
        for gs, ws in zip(g.sequences, w.sequences):
            assert gs.tokens == ws.tokens and gs.stop_reason == ws.stop_reason
            np.testing.assert_allclose(gs.logprobs, ws.logprobs, atol=1e-5)
            assert [row for row in gs.topk_ids] == [row for row in ws.topk_ids]
            np.testing.assert_allclose(gs.topk_logprobs, ws.topk_logprobs, atol=1e-5)
        np.testing.assert_allclose(g.prompt_logprobs, w.prompt_logprobs, atol=1e-5)
        np.testing.assert_array_equal(g.topk_prompt_ids, w.topk_prompt_ids)
        np.testing.assert_allclose(g.topk_prompt_logprobs, w.topk_prompt_logprobs, atol=1e-5)


def test_sampled_logprobs_are_the_raw_models(backend, reference):
    prompt = np.array([5, 17, 42, 99, 7], dtype=np.int32)
    options = SamplingOptions(max_tokens=10, temperature=0.7, top_k=20, top_p=0.9, seed=1234, stop_disabled=True)
    first = backend.sample(B, prompt, 3, options, False)
    again = backend.sample(B, prompt, 3, options, False)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]  # seeded
    assert len({tuple(s.tokens) for s in first.sequences}) > 1  # each sample its own seed
    items = engine_of(backend).generate_calls[-1].sampling_params
    assert [p["sampling_seed"] for p in items] == [derive_seed(1234, i) for i in range(3)]
    for seq in first.sequences:
        full = np.concatenate([prompt, np.array(seq.tokens, dtype=np.int32)])
        raw = reference.compute_logprobs(B, full)[len(prompt):]
        np.testing.assert_allclose(seq.logprobs, raw, atol=1e-5)  # temperature 1, full vocabulary


def test_processed_logprobs_are_the_sampling_distribution(backend, reference):
    prompt = np.array([5, 17, 42, 99, 7], dtype=np.int32)
    options = SamplingOptions(max_tokens=8, temperature=0.7, top_k=20, seed=7, stop_disabled=True, processed_logprobs=True)
    got = backend.sample(A, prompt, 1, options, False).sequences[0]
    fields = engine_of(backend).generate_calls[-1]
    assert fields.return_sampling_mask == [True] and fields.sampling_logprobs_mode == ["selected"]
    want = reference.sample(A, prompt, 1, SamplingOptions(**{**options.__dict__, "seed": derive_seed(7, 0)}), False)
    assert got.tokens == want.sequences[0].tokens
    np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, atol=1e-5)
    raw = reference.compute_logprobs(A, np.concatenate([prompt, np.array(got.tokens, dtype=np.int32)]))[len(prompt):]
    assert not np.allclose(got.logprobs, raw, atol=1e-3)
    greedy = backend.sample(A, prompt, 1, SamplingOptions(max_tokens=4, temperature=0.0, stop_disabled=True,
                                                          processed_logprobs=True), False).sequences[0]
    assert greedy.logprobs == [0.0] * 4  # a point mass, as the torch backend reports
    all_k = backend.sample(A, prompt, 1, SamplingOptions(max_tokens=3, temperature=0.9, seed=1, stop_disabled=True,
                                                         processed_logprobs=True), False)  # top_k 0 -> vocabulary size
    assert engine_of(backend).generate_calls[-1].sampling_params[0]["top_k"] == backend.facts.vocab_size
    assert len(all_k.sequences[0].logprobs) == 3


def test_compute_logprobs_equals_the_torch_backend(backend, reference):
    prompt = np.array([4, 8, 15, 16, 23, 42, 99], dtype=np.int32)
    for key in (None, C):
        np.testing.assert_allclose(backend.compute_logprobs(key, prompt), reference.compute_logprobs(key, prompt),
                                   atol=1e-5, equal_nan=True)
        np.testing.assert_allclose(backend.compute_logprobs(key, prompt, 3), reference.compute_logprobs(key, prompt, 3),
                                   atol=1e-5, equal_nan=True)
    assert engine_of(backend).generate_calls[-1].sampling_params[0]["max_new_tokens"] == 0  # prefill only


def test_stops_map_onto_sglang(backend, reference):
    prompt = np.array([5, 17, 42], dtype=np.int32)
    eos = sorted(backend.facts.eos_ids)
    free = backend.sample(None, prompt, 1, SamplingOptions(max_tokens=12, temperature=0.0, stop_disabled=True), False)
    stop_id = free.sequences[0].tokens[3]
    with_ids = backend.sample(None, prompt, 1, SamplingOptions(max_tokens=12, temperature=0.0,
                                                               stop_token_ids=(stop_id, *eos)), False).sequences[0]
    assert with_ids.stop_reason == "stop" and with_ids.tokens[-1] == stop_id  # the stop token is kept
    params = engine_of(backend).generate_calls[-1].sampling_params[0]
    assert not params["ignore_eos"] and set(params["stop_token_ids"]) == {stop_id, *eos}
    text = reference.loaded.tokenizer.decode(free.sequences[0].tokens[2:4])
    strings = SamplingOptions(max_tokens=12, temperature=0.0, stop_strings=(text,))
    got = backend.sample(None, prompt, 1, strings, False).sequences[0]
    assert engine_of(backend).generate_calls[-1].sampling_params[0]["ignore_eos"]  # strings only: no EOS stop
    assert got.tokens == reference.sample(None, prompt, 1, strings, False).sequences[0].tokens
    assert engine_of(backend).generate_calls[-2].sampling_params[0]["stop"] == []
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        backend.sample(None, prompt, 1, SamplingOptions(max_tokens=4, stop_token_ids=(stop_id,)), False)


def test_refusals_name_the_option():
    facts = ModelFacts(vocab_size=50_000, eos_ids=frozenset({2}), deterministic=False, mask_max_tokens=4096)
    with pytest.raises(InvalidArgument, match="^seed"):
        check_options(SamplingOptions(seed=3), facts)
    with pytest.raises(InvalidArgument, match="^processed_logprobs"):
        check_options(SamplingOptions(temperature=1.0, processed_logprobs=True), facts)  # top_k all > mask cap
    check_options(SamplingOptions(temperature=1.0, top_k=50, processed_logprobs=True), facts)
    check_options(SamplingOptions(temperature=0.0, processed_logprobs=True), facts)
    with pytest.raises(InvalidArgument, match="^stop_token_ids"):
        check_options(SamplingOptions(stop_token_ids=(7,)), facts)
    check_options(SamplingOptions(stop_token_ids=(7, 2)), facts)
    check_options(SamplingOptions(stop_token_ids=(7,), stop_disabled=True), facts)


def test_refusal_through_the_servicer_is_invalid_argument(backend, tmp_path):
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=8)
    request = sampler_pb2.SamplerSampleRequest(
        prompt_tokens=encode_tokens([5, 6, 7]), num_samples=1,
        sampling_params=types_pb2.SamplingParams(max_tokens=4, temperature=1.0, stop_token_ids=encode_tokens([9])))
    with pytest.raises(TemperError) as err:
        asyncio.run(servicer.Sample(request, None))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in str(err.value)
    request.sampling_params.ClearField("stop_token_ids")
    response = asyncio.run(servicer.Sample(request, None))
    assert len(decode_tokens(response.sequences[0].tokens)) == len(decode_floats(response.sequences[0].logprobs))


def test_deterministic_requests_are_refused_never_served_best_effort(backend, tmp_path):
    """SGLang's kernels are not the trainer's batch-invariant primitives (docs/deterministic.md): its
    model info says so, and deterministic requests are refused FAILED_PRECONDITION before any generate."""
    servicer = SamplerServicer(backend, tmp_path, max_num_samples=8)
    info = asyncio.run(servicer.GetModelInfo(sampler_pb2.SamplerModelInfoRequest(), None))
    assert "sglang" in info.deterministic_unsupported and "bit for bit" in info.deterministic_unsupported
    prompt = [5, 6, 7, 8]
    sample = sampler_pb2.SamplerSampleRequest(prompt_tokens=encode_tokens(prompt), num_samples=1, deterministic=True,
                                              sampling_params=types_pb2.SamplingParams(max_tokens=4, temperature=1.0))
    scoring = sampler_pb2.SamplerLogprobsRequest(checkpoint_key=A, prompt_tokens=encode_tokens(prompt), deterministic=True)

    async def stream():
        return [chunk async for chunk in servicer.SampleStream(sample, None)]

    calls = len(engine_of(backend).generate_calls)
    for call in (lambda: servicer.Sample(sample, None), lambda: servicer.ComputeLogprobs(scoring, None), stream):
        with pytest.raises(TemperError) as err:
            asyncio.run(call())
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "sglang" in str(err.value)
    with pytest.raises(TemperError) as err:  # the backend refuses them too, whoever calls it
        backend.sample_batch([SampleRequest(None, np.array(prompt), 1, GREEDY),
                              SampleRequest(A, np.array(prompt), 1, GREEDY, deterministic=True)])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(TemperError) as err:
        backend.compute_logprobs(A, np.array(prompt), deterministic=True)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert len(engine_of(backend).generate_calls) == calls  # nothing reached SGLang
    sample.deterministic = scoring.deterministic = False  # the same requests, default mode: served
    assert len(asyncio.run(servicer.Sample(sample, None)).sequences) == 1
    assert len(decode_array(asyncio.run(servicer.ComputeLogprobs(scoring, None)).logprobs)) == len(prompt)


def test_both_backends_report_the_same_version_spans(backend, reference, tmp_path):
    """Every sequence and streamed piece carries its tokens' versions (docs/async_rl.md). A request on one
    version (in-flight, snapshot, base model) gets the same spans from both backends, through Sample and
    through SampleStream's pieces (first_token counted from the sequence's start). SGLang never asks a
    request's ``retarget``: a running SGLang request stays on the adapter it started on."""
    inflight = types_pb2.WeightsVersion(path="tinker://run1/sampler_weights/inflight-3", version=3)
    cases = [(A, inflight, "run1"), (B, types_pb2.WeightsVersion(path="tinker://run2/sampler_weights/b"), ""),
             ("", types_pb2.WeightsVersion(), "")]

    async def spans(servicer, request):
        whole = await servicer.Sample(request, None)
        pieces = [[] for _ in range(request.num_samples)]
        async for chunk in servicer.SampleStream(request, None):
            for piece in chunk.pieces:
                told = sum(len(decode_tokens(p.tokens)) for p in pieces[piece.index])
                assert [(v.first_token, v.count) for v in piece.versions] == (
                    [(told, len(decode_tokens(piece.tokens)))] if piece.tokens else [])
                pieces[piece.index].append(piece)
        return ([[(v.weights.path, v.weights.version, v.first_token, v.count) for v in seq.versions] for seq in whole.sequences],
                [[(v.weights.path, v.weights.version, v.first_token, v.count) for p in seq for v in p.versions]
                 for seq in pieces])

    for key, weights, run in cases:
        request = sampler_pb2.SamplerSampleRequest(
            checkpoint_key=key, prompt_tokens=encode_tokens([5, 17, 42, 9]), num_samples=2, weights=weights,
            inflight_run=run, sampling_params=types_pb2.SamplingParams(max_tokens=5, temperature=0.0, stop_disabled=True))
        got = {name: asyncio.run(spans(SamplerServicer(b, tmp_path / name, max_num_samples=8), request))
               for name, b in (("sglang", backend), ("torch", reference))}
        whole = [[(weights.path, weights.version, 0, 5)]] * 2
        per_token = [[(weights.path, weights.version, j, 1) for j in range(5)]] * 2
        assert got["torch"] == (whole, per_token)   # the torch backend streams one token per piece
        assert got["sglang"][0] == whole and [merge_spans(s) for s in got["sglang"][1]] == whole

    asked = []
    result = backend.sample_batch([SampleRequest(A, np.array([5, 17, 42]), 1, GREEDY, weights=WeightsVersion("a", 1),
                                                 retarget=lambda now: asked.append(now) or (B, WeightsVersion("b", 2)))])
    assert asked == [] and result[0].sequences[0].versions == [VersionSpan(WeightsVersion("a", 1), 0, GREEDY.max_tokens)]


def test_both_backends_reuse_prompt_prefixes_only_within_one_client_tenant_and_version(backend, tiny_model_dir, folders):
    """The prefix cache's scope (docs/async_rl.md) on both backends: the torch backend's own cache, and
    SGLang's radix cache through the ``extra_key`` namespace Temper sets. A prompt asked again by the
    same sampling client of the same tenant on the same adapter reports prompt_cache_hit_tokens > 0;
    another client, another tenant with the same client id, another adapter, or no client: 0."""
    cached = TorchSamplerBackend(load_model(tiny_model_dir), prefix_cache_bytes=64 << 20)
    for key, folder in folders.items():
        cached.load_adapter(key, folder)
    prompt = np.array([5, 17, 42, 9, 33, 8, 61, 12])

    def hits(b, key, tenant, session):
        [result] = b.sample_batch([SampleRequest(key, prompt, 1, GREEDY, tenant=tenant, cache_session=session)])
        return result.prompt_cache_hit_tokens

    for name, b in (("sglang", backend), ("torch", cached)):
        assert hits(b, A, "t1", "s1") == 0, name
        again = hits(b, A, "t1", "s1")
        assert 0 < again <= len(prompt), name
        assert [hits(b, A, "t1", "s2"), hits(b, A, "t2", "s1"), hits(b, B, "t1", "s1"), hits(b, A, "t1", ""),
                hits(b, A, "t1", "")] == [0, 0, 0, 0, 0], name
    namespaces = {k for call in engine_of(backend).generate_calls[-7:] for k in call.extra_key}
    assert len(namespaces) == 6  # the repeat shares the first's; each other request has its own


def merge_spans(spans: list[tuple]) -> list[tuple]:
    out: list[tuple] = []
    for path, version, first, count in spans:
        if out and out[-1][:2] == (path, version) and out[-1][2] + out[-1][3] == first:
            out[-1] = (path, version, out[-1][2], out[-1][3] + count)
        else:
            out.append((path, version, first, count))
    return out


async def push(servicer: SamplerServicer, key: str, folder) -> None:
    async def chunks():
        yield sampler_pb2.PushAdapterChunk(checkpoint_key=key)
        for name in WEIGHT_FILES:
            data = (folder / name).read_bytes()
            yield sampler_pb2.PushAdapterChunk(file=types_pb2.FileChunk(relative_path=name, data=data, total_size=len(data)))

    await servicer.PushAdapter(chunks(), None)


def test_adapter_lifecycle_load_use_evict_reload(tiny_model_dir, folders, reference, tmp_path):
    with pytest.MonkeyPatch.context() as patch:
        backend = make_backend(tiny_model_dir, patch)
        engine = engine_of(backend)
        servicer = SamplerServicer(backend, tmp_path, max_num_samples=8, max_adapters=2)
        prompt = np.array([5, 17, 42, 99], dtype=np.int32)

        async def scenario():
            await push(servicer, A, folders[A])
            await push(servicer, B, folders[B])
            assert set(engine.adapters) == {f"{A}@1", f"{B}@2"}
            many = [SampleRequest(A if i % 2 else B, prompt, 1, GREEDY) for i in range(6)]
            results = backend.sample_batch(many)  # many requests on both adapters, one generate call
            for request, result in zip(many, results):
                want = reference.sample(request.checkpoint_key, prompt, 1, GREEDY, False)
                assert result.sequences[0].tokens == want.sequences[0].tokens
            servicer.residency.use(B)  # B most recently used: A goes when C arrives
            await push(servicer, C, folders[C])
            assert set(engine.adapters) == {f"{B}@2", f"{C}@3"}  # unloaded from SGLang, not just forgotten
            with pytest.raises(AdapterNotLoaded):
                backend.sample(A, prompt, 1, GREEDY, False)
            await push(servicer, A, folders[A])  # pushed again: a new name, never the unloaded one
            assert f"{A}@4" in engine.adapters and f"{A}@1" not in engine.adapters
            got = backend.sample(A, prompt, 1, GREEDY, False).sequences[0].tokens
            assert got == reference.sample(A, prompt, 1, GREEDY, False).sequences[0].tokens
            backend.load_adapter(A, folders[B])  # a new version of a loaded key: swapped, the old one unloaded
            assert f"{A}@5" in engine.adapters and f"{A}@4" not in engine.adapters
            got = backend.sample(A, prompt, 1, GREEDY, False).sequences[0].tokens
            assert got == reference.sample(B, prompt, 1, GREEDY, False).sequences[0].tokens

        asyncio.run(scenario())
        backend.close()


def test_errors_map_to_statuses(backend, folders, tmp_path):
    prompt = np.array([5, 6, 7], dtype=np.int32)
    cases = [(ValueError("sampling_seed must be an integer"), InvalidArgument),
             (RuntimeError("scheduler died"), Internal),
             ({"abort": ("bad request", 400)}, InvalidArgument),
             ({"abort": ("server overloaded", 503)}, Unavailable),
             ({"abort": ("kv cache oom", 500)}, Internal)]
    for failure, error in cases:
        sglang_fake.FAIL_NEXT.append(failure)
        with pytest.raises(error):
            backend.sample(None, prompt, 1, GREEDY, False)
    assert not sglang_fake.FAIL_NEXT
    engine = engine_of(backend)
    name = backend._names[C]
    folder = engine.adapters.pop(name)  # SGLang lost it behind our back: "not loaded" -> the scheduler re-pushes
    with pytest.raises(AdapterNotLoaded):
        backend.sample(C, prompt, 1, GREEDY, False)
    engine.adapters[name] = folder
    with pytest.raises(InvalidArgument, match="context length"):
        backend.sample(None, np.arange(3, 2040, dtype=np.int32) % 500, 1, SamplingOptions(max_tokens=64), False)
    big = tmp_path / "big"
    big.mkdir()
    scratch = LoraModel(load_model(backend.model_path).model, backend.model_path)
    scratch.add("big", AdapterSpec(rank=128, alpha=8, targets=("q_proj",)))
    scratch.save("big", big)
    with pytest.raises(InvalidArgument, match="max_lora_rank"):
        backend.load_adapter("run9/sampler_weights/big", big)
    assert "run9/sampler_weights/big" not in backend.describe().loaded_checkpoints
    with pytest.raises(InvalidArgument, match="peft"):
        backend.load_adapter("run9/sampler_weights/none", tmp_path)


def write_adapter(folder, config: dict, tensors: dict) -> None:
    """A peft adapter folder from a config and tensors (no model needed)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


MOE_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
              "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
              "rank_pattern": {"mlp.experts.gate_up_proj": 2, "mlp.experts.down_proj": 2}}
MOE_TENSORS = {  # peft's ParamWrapper names (gate_up_proj nested under base_layer, down_proj not)
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 4),
    "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight": torch.zeros(2 * 4, 8),
    "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight": torch.zeros(32, 2 * 4),
    "base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.zeros(2 * 4, 16),
    "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.zeros(8, 2 * 4),
}


def test_expert_lora_is_refused_by_name_and_changes_nothing(backend, folders, reference, tmp_path):
    engine = engine_of(backend)
    before = (set(engine.adapters), dict(backend._names), backend._version, backend.describe().loaded_checkpoints)
    moe = tmp_path / "moe"
    write_adapter(moe, MOE_CONFIG, MOE_TENSORS)
    with pytest.raises(InvalidArgument) as err:
        backend.load_adapter("run7/sampler_weights/moe", moe)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value) == ("SGLang 0.5.23 cannot serve LoRA on routed experts (target_parameters "
                              "mlp.experts.gate_up_proj, mlp.experts.down_proj); use TEMPER_SAMPLER_BACKEND=torch "
                              "for this adapter")
    keys_only = tmp_path / "keys_only"  # the expert tensors alone give it away too
    write_adapter(keys_only, {k: v for k, v in MOE_CONFIG.items() if k not in ("target_parameters", "rank_pattern")},
                  MOE_TENSORS)
    with pytest.raises(InvalidArgument, match=r"routed experts \(peft expert tensors such as .*mlp\.experts\."):
        backend.load_adapter("run7/sampler_weights/moe", keys_only)
    servicer = SamplerServicer(backend, tmp_path / "pushed", max_num_samples=8)  # over the wire: the same status
    with pytest.raises(TemperError) as err:
        asyncio.run(push(servicer, "run7/sampler_weights/moe", moe))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "target_parameters mlp.experts.gate_up_proj" in str(err.value)
    after = (set(engine.adapters), dict(backend._names), backend._version, backend.describe().loaded_checkpoints)
    assert after == before  # nothing reached SGLang, no version was used up

    # dense adapters still load and sample: peft's empty MoE fields, and (as Temper writes an MoE model's dense
    # MLPs) linears named through target_parameters "<linear>.weight", which SGLang is told as target_modules
    prompt = np.array([5, 17, 42, 99], dtype=np.int32)
    for source, fields in [(A, dict(target_parameters=None, rank_pattern={}, alpha_pattern={})),
                           (B, dict(target_modules=[], target_parameters=["gate_proj.weight", "up_proj.weight"]))]:
        dense, key = tmp_path / f"dense-{len(fields)}", f"run8/sampler_weights/dense-{len(fields)}"
        config = {**json.loads((folders[source] / "adapter_config.json").read_text()), **fields}
        write_adapter(dense, config, load_file(str(folders[source] / "adapter_model.safetensors")))
        backend.load_adapter(key, dense)
        seen = json.loads((engine.adapters[backend._names[key]] / "adapter_config.json").read_text())
        assert not seen.get("target_parameters") and set(seen["target_modules"]) == set(SPECS[source].targets)
        got = backend.sample(key, prompt, 1, GREEDY, False).sequences[0].tokens
        assert got == reference.sample(source, prompt, 1, GREEDY, False).sequences[0].tokens
        backend.drop_adapter(key)
    assert set(engine.adapters) == before[0]


def test_check_servable_names_each_piece_sglang_cannot_serve():
    attn = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    plain = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    check_servable(dict(plain, target_parameters=[], rank_pattern={}, alpha_pattern={}), attn, shared_experts_fused=True)
    with pytest.raises(InvalidArgument, match=r"^SGLang 0\.5\.23 cannot serve per-module ranks .*rank_pattern"):
        check_servable(dict(plain, rank_pattern={"q_proj": 4}), attn, shared_experts_fused=False)
    with pytest.raises(InvalidArgument, match=r"per-module ranks or scales \(alpha_pattern"):
        check_servable(dict(plain, alpha_pattern={"q_proj": 2}), attn, shared_experts_fused=False)
    mla = "base_model.model.model.layers.0.self_attn.{}.lora_A.weight"
    check_servable(plain, [mla.format(m) for m in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj")],
                   shared_experts_fused=False)  # MLA: SGLang fuses q_a + kv_a, serves q_b / kv_b
    with pytest.raises(InvalidArgument, match="kv_a_proj_with_mqa without q_a_proj"):
        check_servable(plain, [mla.format("kv_a_proj_with_mqa"), mla.format("kv_b_proj")], shared_experts_fused=False)
    shared = ["base_model.model.model.layers.3.mlp.shared_experts.gate_proj.lora_A.weight"]
    check_servable(plain, shared, shared_experts_fused=False)  # its own module: served
    with pytest.raises(InvalidArgument, match="shared experts fused into the routed experts.*disable_shared_experts_fusion"):
        check_servable(plain, shared, shared_experts_fused=True)


def test_engine_kwargs_and_seed_refusal_without_deterministic(tiny_model_dir):
    settings = SamplerSettings(base_model=tiny_model_dir, backend="sglang", sglang_deterministic=False,
                               sglang_engine_args={"attention_backend": "fa3"})
    kwargs = engine_kwargs(settings, tiny_model_dir)
    assert kwargs["enable_deterministic_inference"] is False and kwargs["attention_backend"] == "fa3"
    assert set(kwargs) - {"attention_backend"} <= sglang_fake.SERVER_ARGS


def test_the_cpu_install_never_imports_sglang():
    code = ("import sys, temper.services.sampler.__main__, temper.services.sampler.sglang_backend, "
            "temper.services.sampler.sglang_requests; assert 'sglang' not in sys.modules, 'sglang imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_extra_pins_the_version_the_fake_mirrors():
    import tomllib
    from pathlib import Path

    from temper.services.sampler.sglang_backend import SGLANG_VERSION

    repo = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang=={SGLANG_VERSION}"] and sglang_fake.__version__ == SGLANG_VERSION
    assert not any("sglang" in req for name, reqs in extras.items() if name != "sglang" for req in reqs)
    assert "sglang" not in (repo / "Makefile").read_text()  # never in the default CPU venv


# ---- tensor- and data-parallel sizes ------------------------------------------------------------

def test_tp_size_reaches_the_engine_and_samples_the_same(tiny_model_dir, folders, reference):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("temper.services.sampler.sglang_backend.visible_gpus", lambda: 4)
        patch.setenv("TEMPER_SAMPLER_TP_SIZE", "2")  # read from the environment, as the sampler does
        backend = make_backend(tiny_model_dir, patch)
        args = engine_of(backend).args
        assert (args["tp_size"], args["dp_size"]) == (2, 1) and (backend.tp_size, backend.dp_size) == (2, 1)
        backend.load_adapter(A, folders[A])  # runtime adapters work with TP (SGLang shards them per rank)
        prompt = np.array([5, 17, 42, 99], dtype=np.int32)
        got = backend.sample(A, prompt, 1, GREEDY, False).sequences[0].tokens
        assert got == reference.sample(A, prompt, 1, GREEDY, False).sequences[0].tokens
        backend.close()
        # 4 ranks over the tiny model's 2 KV heads: SGLang replicates them, so it is accepted
        backend = make_backend(tiny_model_dir, patch, tp_size=4)
        assert engine_of(backend).args["tp_size"] == 4
        backend.close()


def test_invalid_parallel_sizes_are_refused_at_startup_naming_the_numbers(tiny_model_dir):
    cases = [  # (settings, visible GPUs, what the refusal says); the tiny model has 4 heads, 2 KV heads
        (dict(tp_size=3), 8, r"^TEMPER_SAMPLER_TP_SIZE=3 does not divide the model's 4 attention heads"),
        (dict(tp_size=8), 8, r"^TEMPER_SAMPLER_TP_SIZE=8 does not divide the model's 4 attention heads"),
        (dict(dp_size=2), 8, r"^TEMPER_SAMPLER_DP_SIZE=2: SGLang 0\.5\.23 loads LoRA adapters at runtime only "
                             r"with one data-parallel replica .*run 2 samplers instead"),
        (dict(tp_size=2, dp_size=2), 8, r"^TEMPER_SAMPLER_DP_SIZE=2"),
        (dict(tp_size=2), 1, r"^TEMPER_SAMPLER_TP_SIZE=2 x TEMPER_SAMPLER_DP_SIZE=1 needs 2 visible GPUs .*1 are "
                             r"visible"),
        (dict(tp_size=4, sglang_engine_args={"base_gpu_id": 2}), 4, r"needs 6 visible GPUs \(from base_gpu_id 2"),
        (dict(sglang_engine_args={"tp_size": 2}), 8, r"^set TEMPER_SAMPLER_TP_SIZE instead of tp_size in "
                                                     r"TEMPER_SAMPLER_SGLANG_ENGINE_ARGS"),
        (dict(sglang_engine_args={"enable_dp_attention": True}), 8, r"^attention data parallelism"),
        (dict(tp_size=2, sglang_engine_args={"attn_dp_size": 2}), 8, r"pinned adapters"),
    ]
    for overrides, gpus, message in cases:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("temper.services.sampler.sglang_backend.visible_gpus", lambda gpus=gpus: gpus)
            built = len(sglang_fake.ENGINES)
            with pytest.raises(SamplerConfigError, match=message):
                make_backend(tiny_model_dir, patch, **overrides)
            assert len(sglang_fake.ENGINES) == built, f"{overrides}: refused only after the engine started"
    text = SimpleNamespace(num_attention_heads=12, num_key_value_heads=3)  # heads split over 2, KV heads not
    with pytest.raises(SamplerConfigError, match=r"^TEMPER_SAMPLER_TP_SIZE=2 neither divides nor is a multiple "
                                                 r"of the model's 3 key/value heads"):
        check_parallel(SamplerSettings(base_model=tiny_model_dir, backend="sglang", tp_size=2), text, gpus=2)
    nested = SimpleNamespace(get_text_config=lambda: SimpleNamespace(num_attention_heads=6, num_key_value_heads=None))
    with pytest.raises(SamplerConfigError, match="model's 6 attention heads"):  # a multimodal config's text part
        check_parallel(SamplerSettings(base_model=tiny_model_dir, backend="sglang", tp_size=4), nested, gpus=4)
    for field in ("tp_size", "dp_size"):
        with pytest.raises(ValueError, match=field):
            SamplerSettings(base_model=tiny_model_dir, **{field: 0})


def test_the_fake_refuses_what_sglang_0_5_23_refuses(tiny_model_dir, folders):
    """Why Temper checks first: SGLang's own refusals are bare asserts, at engine start or at the first load."""
    with pytest.raises(AssertionError):
        sglang_fake.Engine(model_path=tiny_model_dir, tp_size=3)
    engine = sglang_fake.Engine(model_path=tiny_model_dir, enable_lora=True, max_lora_rank=64,
                                lora_target_modules=["all"], dp_size=2)
    config = json.loads((folders[A] / "adapter_config.json").read_text())
    with pytest.raises(AssertionError, match="data-parallel replicas are not supported for dynamic lora loading"):
        engine.load_lora_adapter_from_tensors("x", load_file(str(folders[A] / "adapter_model.safetensors")), config)
    engine.shutdown()


def test_the_torch_backend_runs_on_one_device(tiny_model_dir):
    from temper.services.sampler.__main__ import build_backend

    for sizes in (dict(tp_size=2), dict(dp_size=2)):
        with pytest.raises(SamplerConfigError, match="^the torch sampler backend runs on one device: "
                                                     "TEMPER_SAMPLER_TP_SIZE=.*TEMPER_SAMPLER_BACKEND=sglang"):
            build_backend(SamplerSettings(base_model=tiny_model_dir, backend="torch", **sizes))
    assert build_backend(SamplerSettings(base_model=tiny_model_dir)).name == "torch"
    env = {**os.environ, "TEMPER_SAMPLER_INTERNAL_AUTH": "disabled", "TEMPER_SAMPLER_TP_SIZE": "2",
           "TEMPER_SAMPLER_BASE_MODEL": tiny_model_dir, "TEMPER_SAMPLER_METRICS_BIND": "",
           "TEMPER_SAMPLER_BIND": "127.0.0.1:0"}
    proc = subprocess.run([sys.executable, "-m", "temper.services.sampler"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "temper sampler: the torch sampler backend runs on one device" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- image prompts (vision-language models; services/sampler/sglang_images.py) -------------------

@pytest.fixture(scope="module")
def vl(vl_model_dirs, tmp_path_factory):
    """The SGLang backend and the torch backend on the tiny Qwen3-VL, one language-model adapter pushed to both."""
    from temper.services.sampler.sglang_backend import SGLangSamplerBackend as Backend

    folder = vl_model_dirs["qwen3_vl"]
    scratch = LoraModel(load_model(folder).model, folder)
    scratch.add(A, AdapterSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "up_proj")), seed=0)
    with torch.no_grad():
        for p in scratch.adapters[A].params.values():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    adapter = tmp_path_factory.mktemp("vl-adapter")
    scratch.save(A, adapter)
    with pytest.MonkeyPatch.context() as patch:
        sglang_fake.install(patch)
        backend = Backend(SamplerSettings(base_model=folder, backend="sglang"))
        reference = TorchSamplerBackend(load_model(folder))
        for b in (backend, reference):
            b.load_adapter(A, adapter)
        yield backend, reference
        backend.close()


def _vl_prompt(vision, *colors):
    from tests.fixtures_stack import png_bytes
    from temper.services.models import images as image_path

    text = lambda ids: types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(ids)))  # noqa: E731
    chunks = [text([5, 17, 99])]
    for n, color in enumerate(colors):
        chunks += [text([vision.tokens.start]),
                   types_pb2.ModelInputChunk(image=types_pb2.ImageChunk(data=png_bytes(color, (64, 64 + 32 * n)),
                                                                        format="png")),
                   text([vision.tokens.end])]
    chunks.append(text([140, 7, 33, 60]))
    return image_path.flatten(types_pb2.ModelInput(chunks=chunks), vision)


def test_image_prompts_with_lora_sample_what_the_torch_backend_samples(vl):
    backend, reference = vl
    assert backend.describe().vision.info() == reference.loaded.vision.info()
    red, two = _vl_prompt(backend.vision, "red"), _vl_prompt(backend.vision, "blue", "green")
    requests = [SampleRequest(A, red.tokens, 1, GREEDY, images=red.images),
                SampleRequest(None, two.tokens, 1, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=2,
                              prompt_logprobs_last_n=4, images=two.images),
                SampleRequest(A, np.array([5, 6, 7, 8], dtype=np.int32), 1, GREEDY)]
    got, want = backend.sample_batch(requests), reference.sample_batch(requests)
    for g, w in zip(got, want):
        assert g.sequences[0].tokens == w.sequences[0].tokens
        np.testing.assert_allclose(g.sequences[0].logprobs, w.sequences[0].logprobs, atol=1e-5)
    np.testing.assert_allclose(got[1].prompt_logprobs, want[1].prompt_logprobs, atol=1e-5, equal_nan=True)
    np.testing.assert_array_equal(got[1].topk_prompt_ids, want[1].topk_prompt_ids)
    # what reached SGLang: data URLs per item ([] for text) and one image token per image, which SGLang expands
    sent = engine_of(backend).generate_calls[-1]
    image_token = backend.vision.tokens.image
    assert [len(images) for images in sent.image_data] == [1, 2, 0]
    assert all(url.startswith("data:image/png;base64,") for url in sent.image_data[1])
    assert [ids.count(image_token) for ids in sent.input_ids] == [1, 2, 0]
    assert len(sent.input_ids[1]) == len(two.tokens) - sum(i.tokens - 1 for i in two.images)
    np.testing.assert_allclose(backend.compute_logprobs(A, red.tokens, last_n=4, images=red.images),
                               reference.compute_logprobs(A, red.tokens, last_n=4, images=red.images), atol=1e-5,
                               equal_nan=True)


def test_scoring_image_positions_and_tower_lora_are_refused_by_name(vl):
    from temper.common.errors import FailedPrecondition

    backend, _ = vl
    red = _vl_prompt(backend.vision, "red")
    calls = len(engine_of(backend).generate_calls)
    for call in (lambda: backend.compute_logprobs(A, red.tokens, images=red.images),
                 lambda: backend.compute_logprobs(None, red.tokens, last_n=6, images=red.images),
                 lambda: backend.sample_batch([SampleRequest(A, red.tokens, 1, GREEDY, prompt_logprobs=True,
                                                             images=red.images)])):
        with pytest.raises(FailedPrecondition, match="SGLang 0.5.23 cannot score prompt positions that hold image "
                                                     "tokens.*schedule_batch.py"):
            call()
    assert len(engine_of(backend).generate_calls) == calls  # refused before SGLang saw it
    with pytest.raises(InvalidArgument, match="SGLang 0.5.23 cannot serve LoRA on the vision tower"):
        check_servable({"r": 4, "lora_alpha": 8, "target_modules": ["qkv", "q_proj"]},
                       ["base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight",
                        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"],
                       shared_experts_fused=False)
    with pytest.raises(InvalidArgument, match="appears where no image is"):
        backend.compute_logprobs(None, np.array([5, backend.vision.tokens.image, 6], dtype=np.int32))
