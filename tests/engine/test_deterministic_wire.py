"""Deterministic mode through the workers' protobuf faces (docs/deterministic.md): the trainer's RunCycle
carries ForwardBackwardItem.deterministic; the sampler's ComputeLogprobs and Sample with deterministic set
score prompts alone at their true length, torch.equal to the trainer's forward logprobs on the same
tokens (several lengths, across the 64-key block boundary, alone and batched with other requests);
top-k, stop strings, processed logprobs and streaming in deterministic mode; GetModelInfo's
deterministic_unsupported (empty for dense llama/qwen3, the family's reason for an MoE family, a
reason for a sharded trainer group) and the refusals that go with it."""

import asyncio

import grpc
import numpy as np
import pytest
import torch

from ranks import free_port, run_ranks
from test_trainer_engine import datum
from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_tokens
from temper.common.errors import FailedPrecondition, TemperError
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.servicer import TrainerServicer
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import sampler_pb2, trainer_pb2, types_pb2

SPEC = AdapterSpec(rank=4, alpha=8.0, targets=lora_targets(attn=True, mlp=True, unembed=True))
KEY = "t/run/ckpt-1"
LENGTHS = (5, 40, 64, 65, 90, 130)  # under the 16-row pad, across the 64-key block boundary


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp_path_factory, one_torch_thread):
    """A trainer with a trained-looking run (B != 0) and a default run; a torch sampler serving the run's
    checkpoint; both behind their servicers."""
    engine = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(checkpoint_dir=tmp_path_factory.mktemp("ckpt")))
    engine.create_adapter("run", SPEC, 5)
    engine.create_adapter("other", SPEC, 6)
    with torch.no_grad():
        for name, p in engine.host.get("run").params.items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    engine.save("run", KEY, include_optimizer=False)
    backend = TorchSamplerBackend(load_model(tiny_model_dir))
    backend.load_adapter(KEY, engine.store.existing(KEY))
    return TrainerServicer(engine), SamplerServicer(backend, tmp_path_factory.mktemp("pushed"), max_num_samples=8)


def trainer_logprobs(trainer: TrainerServicer, sequences) -> list[np.ndarray]:
    """The trainer's logprobs of each sequence (inputs tokens[:-1], targets tokens[1:]) from one RunCycle:
    a deterministic training item per sequence, co-batched with a default run's item."""
    items = [trainer_pb2.ForwardBackwardItem(training_run_id="run", loss_fn="cross_entropy", deterministic=True,
                                             data=[datum(list(s), np.ones(len(s) - 1, np.float32))]) for s in sequences]
    noise = trainer_pb2.ForwardBackwardItem(training_run_id="other", loss_fn="cross_entropy",
                                            data=[datum(list(range(3, 40)), np.ones(36, np.float32))])
    response = asyncio.run(trainer.RunCycle(trainer_pb2.CycleRequest(forward_backward=[noise, *items]), None))
    assert all(s.code == 0 for s in response.forward_backward_status), response.forward_backward_status
    return [decode_array(out.loss_fn_outputs[0].fields["logprobs"]) for out in response.forward_backward[1:]]


def logprobs_request(prompt, last_n=None, deterministic=True, key=KEY):
    request = sampler_pb2.SamplerLogprobsRequest(checkpoint_key=key or "", prompt_tokens=encode_tokens(prompt),
                                                 deterministic=deterministic)
    if last_n is not None:
        request.prompt_logprobs_last_n = last_n
    return request


def sample_request(prompt, n=2, key=KEY, deterministic=True, **fields):
    stop_strings = fields.pop("stop_strings", [])  # then no token stops (stop_token_ids unset)
    params = types_pb2.SamplingParams(max_tokens=fields.pop("max_tokens", 6), temperature=1.0, seed=11,
                                      stop_disabled=not stop_strings, stop_strings=stop_strings,
                                      processed_logprobs=fields.pop("processed_logprobs", False))
    return sampler_pb2.SamplerSampleRequest(checkpoint_key=key or "", prompt_tokens=encode_tokens(prompt), num_samples=n,
                                            sampling_params=params, deterministic=deterministic, **fields)


def same(a, b) -> bool:
    return torch.equal(torch.from_numpy(np.asarray(a, np.float32)), torch.from_numpy(np.asarray(b, np.float32)))


def prompts():
    rng = np.random.default_rng(23)
    return [rng.integers(0, 512, n).astype(np.int32) for n in LENGTHS]


def test_compute_logprobs_equals_the_trainers_forward(workers):
    trainer, sampler = workers
    ps = prompts()
    want = trainer_logprobs(trainer, ps)

    async def alone():
        return [decode_array((await sampler.ComputeLogprobs(logprobs_request(p), None)).logprobs) for p in ps]

    async def together():  # with default scoring, a default sample and other lengths in flight at once
        calls = [sampler.ComputeLogprobs(logprobs_request(p), None) for p in ps]
        calls += [sampler.ComputeLogprobs(logprobs_request(ps[1], deterministic=False), None),
                  sampler.Sample(sample_request(ps[2], key=None, deterministic=False), None)]
        answers = await asyncio.gather(*calls)
        return [decode_array(a.logprobs) for a in answers[:len(ps)]]

    for got in (asyncio.run(alone()), asyncio.run(together())):
        for p, g, w in zip(ps, got, want):
            assert np.isnan(g[0]) and same(g[1:], w), len(p)
    last = decode_array(asyncio.run(sampler.ComputeLogprobs(logprobs_request(ps[4], last_n=7), None)).logprobs)
    assert np.isnan(last[:-7]).all() and same(last[-7:], want[4][-7:])
    default = decode_array(asyncio.run(sampler.ComputeLogprobs(logprobs_request(ps[4], deterministic=False), None)).logprobs)
    np.testing.assert_allclose(default[1:], want[4], atol=1e-5)  # the same math, other kernels


def test_sample_prompt_logprobs_and_sampled_tokens_are_the_trainers(workers):
    trainer, sampler = workers
    ps = prompts()

    def scored(i):
        fields = {"include_prompt_logprobs": True, "topk_logprobs": 3}
        if i == 3:
            fields.update(prompt_logprobs_last_n=10, topk_prompt_logprobs=4)
        return sample_request(ps[i], **fields)

    async def batched():  # every prompt in one batch, with a default request
        answers = await asyncio.gather(*[sampler.Sample(scored(i), None) for i in range(len(ps))],
                                       sampler.Sample(sample_request(ps[0], key=None, deterministic=False,
                                                                     include_prompt_logprobs=True), None))
        return answers[:len(ps)]

    together = asyncio.run(batched())
    want = trainer_logprobs(trainer, ps)
    for i, (p, got) in enumerate(zip(ps, together)):
        alone = asyncio.run(sampler.Sample(scored(i), None))
        assert alone == got  # every number: batch-invariant (and seeded)
        prompt_lp = decode_array(got.prompt_logprobs)
        first = len(p) - 10 if i == 3 else 1
        assert np.isnan(prompt_lp[:first]).all() and same(prompt_lp[first:], want[i][first - 1:])
        if i == 3:  # top-k prompt logprobs: the same formula at the k most likely ids
            ids, lps = decode_array(got.topk_prompt_token_ids), decode_array(got.topk_prompt_logprobs)
            assert ids.shape == lps.shape == (len(p), 4) and (ids[:first] == 0).all() and (lps[:first] == -99999.0).all()
            assert (np.diff(lps[first:], axis=1) <= 0).all() and (lps[first:, 0] >= prompt_lp[first:]).all()
            hit = ids[first:] == p[first:, None]
            assert same(lps[first:][hit], np.broadcast_to(prompt_lp[first:, None], hit.shape)[hit])
        sequences = [np.concatenate([p, decode_tokens(s.tokens)]) for s in got.sequences]
        for s, tokens, lp in zip(got.sequences, sequences, trainer_logprobs(trainer, sequences)):
            sampled = decode_floats(s.logprobs)
            assert same(sampled, lp[len(p) - 1:])
            top_ids = decode_tokens(s.topk_token_ids).reshape(-1, 3)
            top_lps = decode_floats(s.topk_logprobs).reshape(-1, 3)
            hit = top_ids == decode_tokens(s.tokens)[:, None]
            assert same(top_lps[hit], np.broadcast_to(sampled[:, None], hit.shape)[hit])


def test_streaming_stop_strings_and_processed_logprobs(workers):
    _, sampler = workers
    p = prompts()[2]
    whole = asyncio.run(sampler.Sample(sample_request(p, max_tokens=8, topk_logprobs=2), None))

    async def streamed():
        return [chunk async for chunk in sampler.SampleStream(sample_request(p, max_tokens=8, topk_logprobs=2), None)]

    chunks = asyncio.run(streamed())
    assert chunks[-1].done
    for k, seq in enumerate(whole.sequences):
        pieces = [piece for chunk in chunks[:-1] for piece in chunk.pieces if piece.index == k]
        assert np.concatenate([decode_tokens(x.tokens) for x in pieces]).tolist() == decode_tokens(seq.tokens).tolist()
        assert same(np.concatenate([decode_floats(x.logprobs) for x in pieces]), decode_floats(seq.logprobs))
        assert b"".join(x.topk_logprobs for x in pieces) == seq.topk_logprobs
        assert pieces[-1].stop_reason == seq.stop_reason
    # a stop string: the same seeded draws, cut where the text appears
    tokens = decode_tokens(whole.sequences[0].tokens).tolist()
    text = sampler.backend.loaded.tokenizer.decode(tokens[:3])  # complete at the third token, not before
    stopped = asyncio.run(sampler.Sample(sample_request(p, max_tokens=8, stop_strings=[text]), None)).sequences[0]
    cut = decode_tokens(stopped.tokens).tolist()
    assert stopped.stop_reason == types_pb2.STOP_REASON_STOP and 1 <= len(cut) <= 3 and cut == tokens[:len(cut)]
    assert same(decode_floats(stopped.logprobs), decode_floats(whole.sequences[0].logprobs)[:len(cut)])
    # processed logprobs: the distribution drawn from (temperature 1, full vocabulary: the raw one's value)
    processed = asyncio.run(sampler.Sample(sample_request(p, max_tokens=8, processed_logprobs=True), None))
    for a, b in zip(processed.sequences, whole.sequences):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(decode_floats(a.logprobs), decode_floats(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_model_info_says_whether_deterministic_mode_is_served(family, family_dirs, tmp_path, one_torch_thread):
    folder = str(family_dirs[family])
    trainer = TrainerServicer(TrainerEngine(load_model(folder), TrainerSettings(checkpoint_dir=tmp_path / "ckpt")))
    sampler = SamplerServicer(TorchSamplerBackend(load_model(folder)), tmp_path / "pushed", max_num_samples=8)
    trainer_info = asyncio.run(trainer.GetModelInfo(trainer_pb2.GetModelInfoRequest(), None))
    sampler_info = asyncio.run(sampler.GetModelInfo(sampler_pb2.SamplerModelInfoRequest(), None))
    if family != "qwen3_moe":
        assert trainer_info.deterministic_unsupported == sampler_info.deterministic_unsupported == ""
        return
    for reason in (trainer_info.deterministic_unsupported, sampler_info.deterministic_unsupported):
        assert "qwen3_moe" in reason and "batch-invariant" in reason
    # and the deterministic requests are refused with that reason, nothing run
    prompt = np.arange(3, 12, dtype=np.int32)
    for call in (sampler.ComputeLogprobs(logprobs_request(prompt, key=None), None),
                 sampler.Sample(sample_request(prompt, key=None), None)):
        with pytest.raises(FailedPrecondition, match="qwen3_moe"):
            asyncio.run(call)
    default = sampler.ComputeLogprobs(logprobs_request(prompt, deterministic=False, key=None), None)
    assert decode_array(asyncio.run(default).logprobs).shape == (9,)
    engine = trainer.engine
    engine.create_adapter("moe", AdapterSpec(rank=2, alpha=4.0, targets=engine.lora.group_targets(attn=True)), 1)
    item = trainer_pb2.ForwardBackwardItem(training_run_id="moe", loss_fn="cross_entropy", deterministic=True,
                                           data=[datum(list(range(3, 12)), np.ones(8, np.float32))])
    response = asyncio.run(trainer.RunCycle(trainer_pb2.CycleRequest(forward_backward=[item]), None))
    status = response.forward_backward_status[0]
    assert status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "qwen3_moe" in status.message
    assert all(p.grad is None for p in engine.host.get("moe").params.values())


# ---- a sharded trainer group (two local ranks on gloo) ------------------------------------------


def rank_main(rank, addr, folder, checkpoints, out):
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist
        from temper.common.validation import DecodedDatum
        from temper.services.trainer import group
        from temper.services.trainer.engine import ForwardBackwardItem

        settings = group.group_settings(TrainerSettings(base_model=str(folder), checkpoint_dir=checkpoints, num_threads=1,
                                                        offload_dir=checkpoints.parent / "offload", world_size=2,
                                                        rank=rank, group_addr=addr, group_timeout_seconds=20))
        joined = group.join(settings)
        engine = group.build_engine(load_model(settings.base_model), settings, joined)
        got = {}
        if rank == 0:
            leader = group.GroupEngine(engine, joined)
            info = asyncio.run(TrainerServicer(leader).GetModelInfo(trainer_pb2.GetModelInfoRequest(), None))
            got["info"] = (info.world_size, info.deterministic_unsupported)
            for run_id in ("det", "default"):
                leader.create_adapter(run_id, SPEC, 1)
            before = {n: p.detach().clone() for n, p in leader.host.get("det").params.items()}
            tokens = np.arange(3, 20)
            data = [DecodedDatum(tokens=tokens[:-1].astype(np.int32), inputs={
                "target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(len(tokens) - 1, np.float32)})]
            results, _ = leader.run_cycle([ForwardBackwardItem("det", data, deterministic=True),
                                           ForwardBackwardItem("default", data)], [])
            adapter = leader.host.get("det")
            got["det"] = (type(results[0]).__name__, getattr(results[0], "code", None) == grpc.StatusCode.FAILED_PRECONDITION,
                          str(results[0]), all(p.grad is None for p in adapter.params.values()),
                          all(torch.equal(before[n], p) for n, p in adapter.params.items()))
            got["default"] = type(results[1]).__name__
            leader.stop()
        else:
            with pytest.raises(SystemExit) as stopped:
                group.follow(engine, joined)
            assert stopped.value.code == 0
        out.put((rank, got))
        dist.destroy_process_group()
    except BaseException:
        import traceback
        out.put((rank, RuntimeError(traceback.format_exc())))
        raise


def test_a_sharded_group_says_so_and_refuses_deterministic_items(tmp_path):
    from temper.services.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    addr = f"127.0.0.1:{free_port()}"
    results = run_ranks(rank_main, lambda r, out: (r, addr, folder, tmp_path / "group" / "ckpt", out))
    got = results[0]
    world, reason = got["info"]
    assert world == 2 and "sharded trainer group (2 ranks)" in reason and "batch-invariant" in reason
    name, failed_precondition, message, no_grads, unchanged = got["det"]
    assert name == "FailedPrecondition" and failed_precondition and "sharded trainer group" in message
    assert no_grads and unchanged  # nothing of the deterministic run changed
    assert got["default"] == "ForwardBackwardResult"  # the default run's item ran in the same cycle
