"""Streamed sampling in the sampler: the torch backend tells each decode step's tokens as it decodes
them, the SGLang backend (against tests/engine/sglang_fake.py) each streamed output's new tokens, and
the servicer's SampleStream sends them; joined, the pieces are exactly what non-streamed sampling
answers for the same request and seed (tokens, logprobs, top-k, stop reasons), batched with
non-streamed requests or not."""

import asyncio
import threading

import numpy as np
import pytest

import sglang_fake
from temper.common.codec import decode_floats, decode_tokens, encode_tokens
from temper.services.models.loading import load_model
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.settings import SamplerSettings
from temper.services.sampler.sglang_backend import SGLangSamplerBackend
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, types_pb2

PROMPT = np.array([5, 17, 42, 99, 7], dtype=np.int32)
SAMPLED = SamplingOptions(max_tokens=9, temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def torch_backend(tiny_model_dir):
    return TorchSamplerBackend(load_model(tiny_model_dir))


@pytest.fixture(scope="module")
def sglang_backend(tiny_model_dir):
    with pytest.MonkeyPatch.context() as patch:
        sglang_fake.install(patch)
        backend = SGLangSamplerBackend(SamplerSettings(base_model=tiny_model_dir, backend="sglang"))
        yield backend
        backend.close()


class Recorder:
    """A request's progress: every call, in order, with the thread it came on."""

    def __init__(self):
        self.calls: list[list] = []
        self.threads: set[int] = set()

    def __call__(self, pieces):
        self.calls.append(pieces)
        self.threads.add(threading.get_ident())

    def joined(self, n: int) -> list[dict]:
        out = [{"tokens": [], "logprobs": [], "topk_ids": [], "topk_logprobs": [], "ends": []} for _ in range(n)]
        for pieces in self.calls:
            for p in pieces:
                seq = out[p.sequence]
                assert not seq["ends"], "a piece after the sequence's last one"
                seq["tokens"] += p.tokens
                seq["logprobs"] += p.logprobs
                seq["topk_ids"] += p.topk_ids or []
                seq["topk_logprobs"] += p.topk_logprobs or []
                if p.stop_reason is not None:
                    seq["ends"].append(p.stop_reason)
        return out


def assert_joined_equal(recorder: Recorder, result) -> None:
    for got, want in zip(recorder.joined(len(result.sequences)), result.sequences, strict=True):
        assert got["tokens"] == want.tokens and got["ends"] == [want.stop_reason]
        np.testing.assert_array_equal(got["logprobs"], want.logprobs)
        if want.topk_ids is not None:
            assert got["topk_ids"] == want.topk_ids and got["topk_logprobs"] == want.topk_logprobs


def requests(recorders: list):
    return [SampleRequest(None, PROMPT, 3, SAMPLED, topk_logprobs=2, progress=recorders[0]),
            SampleRequest(None, PROMPT[:3], 1, SamplingOptions(max_tokens=4, temperature=0.0, stop_disabled=True)),
            SampleRequest(None, PROMPT[1:], 2, SamplingOptions(max_tokens=6, temperature=0.7, seed=3,
                                                                stop_token_ids=(1, 2, 3, 4, 5, 6, 7, 8)),
                          progress=recorders[1])]


@pytest.mark.parametrize("which", ["torch_backend", "sglang_backend"])
def test_streamed_pieces_joined_are_the_non_streamed_answer(which, request):
    backend = request.getfixturevalue(which)
    recorders = [Recorder(), Recorder()]
    streamed = backend.sample_batch(requests(recorders))
    plain = backend.sample_batch(requests([None, None]))
    for got, want in zip(streamed, plain, strict=True):  # streaming changes nothing of the answer
        for g, w in zip(got.sequences, want.sequences, strict=True):
            assert g.tokens == w.tokens and g.stop_reason == w.stop_reason
            np.testing.assert_array_equal(g.logprobs, w.logprobs)
    assert_joined_equal(recorders[0], streamed[0])
    assert_joined_equal(recorders[1], streamed[2])
    # told token by token: torch once per decode step (every sequence still going), SGLang once per output
    longest = max(len(s.tokens) for s in streamed[0].sequences)
    assert all(len(p.tokens) == 1 for c in recorders[0].calls for p in c)
    expected = longest if which == "torch_backend" else sum(len(s.tokens) for s in streamed[0].sequences)
    assert len(recorders[0].calls) == expected
    # a sequence stopped by a stop token ends early, with "stop", while the others go on
    assert any(s.stop_reason == "stop" for s in streamed[2].sequences) or all(
        len(s.tokens) == 6 for s in streamed[2].sequences)


def test_the_servicer_streams_before_the_batch_ends_and_ends_with_the_prompt_scores(torch_backend, tmp_path):
    servicer = SamplerServicer(torch_backend, tmp_path, max_num_samples=8)
    request = sampler_pb2.SamplerSampleRequest(
        prompt_tokens=encode_tokens(PROMPT.tolist()), num_samples=2, include_prompt_logprobs=True, topk_logprobs=1,
        sampling_params=types_pb2.SamplingParams(max_tokens=7, temperature=0.8, seed=4, stop_disabled=True))
    decoded_steps: list[int] = []
    ack = threading.Semaphore(0)
    original = torch_backend.sample_batch

    def lockstep(batch):
        """The decode waits after each step until the caller has that step's message: a servicer that
        sent nothing before the batch ended would leave it waiting (and the counts below wrong)."""
        for r in batch:
            if r.progress is not None:
                def told(pieces, inner=r.progress):
                    decoded_steps.append(1)
                    inner(pieces)
                    ack.acquire(timeout=20)
                r.progress = told
        return original(batch)

    async def scenario():
        torch_backend.sample_batch = lockstep
        try:
            chunks = []
            async for chunk in servicer.SampleStream(request, None):
                chunks.append((chunk, len(decoded_steps)))  # decode steps done when this message arrived
                ack.release()
            return chunks, await servicer.Sample(request, None)
        finally:
            del torch_backend.sample_batch

    chunks, whole = asyncio.run(scenario())
    *pieces, (end, _) = chunks
    assert end.done and not end.pieces and end.HasField("prompt_logprobs")
    assert end.prompt_logprobs == whole.prompt_logprobs
    assert len(pieces) == 7 and all(not c.done for c, _ in pieces)
    assert [steps for _, steps in pieces] == [1, 2, 3, 4, 5, 6, 7]  # each step's message before the next step
    for i, seq in enumerate(whole.sequences):
        mine = [p for c, _ in pieces for p in c.pieces if p.index == i]
        assert b"".join(p.tokens for p in mine) == seq.tokens
        assert np.array_equal(np.concatenate([decode_floats(p.logprobs) for p in mine]), decode_floats(seq.logprobs))
        assert b"".join(p.topk_token_ids for p in mine) == seq.topk_token_ids and all(p.topk == 1 for p in mine)
        assert [p.stop_reason for p in mine] == [types_pb2.STOP_REASON_UNSPECIFIED] * 6 + [seq.stop_reason]
        assert decode_tokens(seq.tokens).size == 7


def test_a_streamed_request_with_pieces_out_is_not_decoded_again_when_its_batch_fails(torch_backend, tmp_path):
    """A batch that fails mid-decode is retried request by request; a streamed one whose caller already
    has pieces gets the error instead (a second decode would send a second, different answer)."""
    servicer = SamplerServicer(torch_backend, tmp_path, max_num_samples=8)
    request = sampler_pb2.SamplerSampleRequest(
        prompt_tokens=encode_tokens(PROMPT.tolist()), num_samples=1,
        sampling_params=types_pb2.SamplingParams(max_tokens=5, temperature=0.8, stop_disabled=True))
    calls = []

    def failing(batch):
        calls.append(len(batch))
        for r in batch:
            if r.progress is not None:
                r.progress([])
        raise RuntimeError("device lost")

    async def scenario():
        torch_backend.sample_batch = failing
        try:
            return [c async for c in servicer.SampleStream(request, None)]
        finally:
            del torch_backend.sample_batch

    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(scenario())
    assert calls == [1]
