"""In-flight weights in the torch sampler, through the servicer without a server (docs/async_rl.md): a
request that follows a run's target moves to the new adapter between two decode steps and its tokens
after the switch are exactly a by-hand greedy decode that switches adapters over the same KV; a pinned
one stays on its version; a request naming an older version starts on the newer one; SetInflightTarget's
refusals change nothing; an adapter pushed while a batch decodes is installed between two of its steps
(and one the batch decodes with is replaced only after it).

The decode is held at chosen forwards by a forward pre-hook (``Gate``) on the compute thread, so each
switch lands on a known step whatever the machine's speed."""

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from temper.common.checkpoints import WEIGHT_FILES
from temper.common.codec import decode_floats, decode_tokens, encode_tokens
from temper.common.errors import AdapterNotLoaded, InvalidArgument
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import load_model
from temper.services.sampler.backend import VersionSpan, WeightsVersion
from temper.services.sampler.convert import spans_from_pb
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, types_pb2
from tests.engine.conftest import random_adapter_folders

SPECS = {
    "A": AdapterSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")),
    "B": AdapterSpec(rank=4, alpha=8, targets=("k_proj", "o_proj", "up_proj")),
    "C": AdapterSpec(rank=2, alpha=4, targets=("gate_proj",)),
}
RUN = "run-r"
PROMPT = [5, 17, 42, 99, 7]
MAX = 12
WAIT = 30.0   # seconds a gate waits before it lets the decode go on (a failing run, never a passing one)


def v(n: int, key: str = "") -> WeightsVersion:
    return WeightsVersion(f"tinker://{RUN}/sampler_weights/inflight-{n}" if n else key, n)


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    return random_adapter_folders(tiny_model_dir, tmp_path_factory, SPECS, scale=0.4, seed=40)


@pytest.fixture(scope="module")
def by_hand(tiny_model_dir, folders):
    """Greedy decode of PROMPT with plain transformers + LoRA: ``keys[j]`` is the adapter whose forward
    computes token j's logits (the prefill for j = 0, else the forward of token j - 1 over the KV of
    everything before it). Returns (tokens, logprobs of each chosen token under its logits)."""
    loaded = load_model(tiny_model_dir)
    lora = LoraModel(loaded.model, tiny_model_dir)
    for key, folder in folders.items():
        spec, weights = LoraModel.read(folder)
        lora.add(key, spec)
        lora.load_weights(key, weights)

    @torch.no_grad()
    def decode(keys: list[str]) -> tuple[list[int], list[float]]:
        with lora.route([(keys[0], None)]):
            out = loaded.model(input_ids=torch.tensor([PROMPT]), use_cache=True)
        tokens, logprobs = [], []
        for j in range(len(keys)):
            lp = out.logits[0, -1].float().log_softmax(-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp[tokens[-1]]))
            if j + 1 < len(keys):
                with lora.route([(keys[j + 1], None)]):
                    out = loaded.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                                       use_cache=True)
        return tokens, logprobs

    return decode


@pytest.fixture
def servicer(tiny_model_dir, tmp_path):
    return SamplerServicer(TorchSamplerBackend(load_model(tiny_model_dir)), tmp_path, max_num_samples=4)


class Gate:
    """A forward pre-hook on the sampler's model (the compute thread) that counts decode forwards (one new
    token per row) and, at forward n, calls ``holds[n]()`` before letting it run."""

    def __init__(self, model, holds: dict):
        self.holds, self.count = holds, 0
        self.reached = {n: threading.Event() for n in holds}   # forward n has begun (is being held)
        self.timed_out: list[int] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if kwargs.get("input_ids") is None or kwargs["input_ids"].shape[1] != 1:
            return None  # a prefill
        self.count += 1
        if self.count in self.holds:
            self.reached[self.count].set()
            if not self.holds[self.count]():
                self.timed_out.append(self.count)
        return None

    def close(self):
        self.handle.remove()


def wait_for(condition, timeout: float = WAIT) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


async def until(condition, timeout: float = WAIT) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.002)


async def push(servicer, key, folder) -> None:
    async def chunks():
        yield sampler_pb2.PushAdapterChunk(checkpoint_key=key)
        for name in WEIGHT_FILES:
            data = (folder / name).read_bytes()
            yield sampler_pb2.PushAdapterChunk(file=types_pb2.FileChunk(relative_path=name, data=data, total_size=len(data)))

    await servicer.PushAdapter(chunks(), None)


async def set_target(servicer, key: str, version: int, run: str = RUN) -> int:
    request = sampler_pb2.SetInflightTargetRequest(training_run_id=run, checkpoint_key=key,
                                                   weights=types_pb2.WeightsVersion(path=v(version).path, version=version))
    return (await servicer.SetInflightTarget(request, None)).version


def sample_request(key: str, version: int, run: str = RUN, pin: bool = False, max_tokens: int = MAX):
    return sampler_pb2.SamplerSampleRequest(
        checkpoint_key=key, prompt_tokens=encode_tokens(PROMPT), num_samples=1, inflight_run=run, pin_version=pin,
        weights=types_pb2.WeightsVersion(path=v(version, key).path, version=version),
        sampling_params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_disabled=True))


async def streamed(servicer, request) -> tuple[list[int], list[float], list[VersionSpan]]:
    """A SampleStream's tokens, logprobs and pieces' spans (each piece's spans as sent)."""
    tokens, logprobs, spans = [], [], []
    async for chunk in servicer.SampleStream(request, None):
        for piece in chunk.pieces:
            piece_spans = spans_from_pb(piece.versions)
            assert sum(s.count for s in piece_spans) == len(decode_tokens(piece.tokens))
            assert piece_spans[0].first == len(tokens)   # counted from the sequence's start
            tokens += decode_tokens(piece.tokens).tolist()
            logprobs += decode_floats(piece.logprobs).tolist()
            spans += piece_spans
    return tokens, logprobs, merge(spans)


def merge(spans: list[VersionSpan]) -> list[VersionSpan]:
    out: list[VersionSpan] = []
    for s in spans:
        if out and out[-1].weights == s.weights and out[-1].first + out[-1].count == s.first:
            out[-1] = VersionSpan(s.weights, out[-1].first, out[-1].count + s.count)
        else:
            out.append(VersionSpan(s.weights, s.first, s.count))
    return out


def held_switch(servicer, released: threading.Event) -> dict:
    """Gate holds for a push of B then SetInflightTarget mid-decode: at forward 3 until the push is queued
    (it is installed after the next step's tokens), at forward 4 until the test released it (the test
    sets the target once forward 4 is held, so the step before cannot see it). The request then moves
    after step 4's token: forward 5 runs on B, so token 5 is B's first."""
    return {3: lambda: wait_for(lambda: len(servicer._installs) > 0), 4: lambda: released.wait(WAIT)}


def test_a_following_request_moves_to_the_new_version_between_decode_steps(servicer, folders, by_hand):
    released = threading.Event()

    async def scenario():
        await push(servicer, "A", folders["A"])
        assert await set_target(servicer, "A", 1) == 1
        gate = Gate(servicer.backend.loaded.model, held_switch(servicer, released))
        try:
            task = asyncio.create_task(streamed(servicer, sample_request("A", 1)))
            await until(gate.reached[3].is_set)
            await asyncio.wait_for(push(servicer, "B", folders["B"]), WAIT)  # installed while the request decodes
            assert not task.done()
            await until(gate.reached[4].is_set)
            assert await set_target(servicer, "B", 2) == 2
            released.set()
            tokens, logprobs, spans = await task
        finally:
            gate.close()
        assert gate.timed_out == []
        assert spans == [VersionSpan(v(1), 0, 5), VersionSpan(v(2), 5, MAX - 5)]
        want_tokens, want_logprobs = by_hand(["A"] * 5 + ["B"] * (MAX - 5))
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
        assert tokens != by_hand(["A"] * MAX)[0]   # the switch changed what was decoded
        assert servicer.residency.pins("A") == 0 and servicer.residency.pins("B") == 0   # every pin released

    asyncio.run(scenario())


def test_a_pinned_request_stays_on_its_version(servicer, folders, by_hand):
    released = threading.Event()

    async def scenario():
        await push(servicer, "A", folders["A"])
        await set_target(servicer, "A", 1)
        gate = Gate(servicer.backend.loaded.model, held_switch(servicer, released))
        try:
            task = asyncio.create_task(servicer.Sample(sample_request("A", 1, pin=True), None))
            await until(gate.reached[3].is_set)
            await asyncio.wait_for(push(servicer, "B", folders["B"]), WAIT)
            await until(gate.reached[4].is_set)
            assert await set_target(servicer, "B", 2) == 2
            released.set()
            response = await task
        finally:
            gate.close()
        assert gate.timed_out == []
        (seq,) = response.sequences
        assert spans_from_pb(seq.versions) == [VersionSpan(v(1), 0, MAX)]
        want_tokens, want_logprobs = by_hand(["A"] * MAX)
        assert decode_tokens(seq.tokens).tolist() == want_tokens
        np.testing.assert_allclose(decode_floats(seq.logprobs), want_logprobs, atol=1e-5)
        assert servicer.residency.pins("A") == 0 and servicer.residency.pins("B") == 0

    asyncio.run(scenario())


def test_a_request_naming_an_older_version_starts_on_the_newer(servicer, folders, by_hand):
    async def scenario():
        for key in "ABC":
            await push(servicer, key, folders[key])
        await set_target(servicer, "A", 1)
        assert await set_target(servicer, "B", 2) == 2
        want_b = by_hand(["B"] * MAX)
        for pin in (False, True):   # pinned too: its first version is the newest
            response = await servicer.Sample(sample_request("A", 1, pin=pin), None)
            (seq,) = response.sequences
            assert spans_from_pb(seq.versions) == [VersionSpan(v(2), 0, MAX)]
            assert decode_tokens(seq.tokens).tolist() == want_b[0]
            np.testing.assert_allclose(decode_floats(seq.logprobs), want_b[1], atol=1e-5)
        # a request naming a newer version than held moves the target (the scheduler sends the newest)
        response = await servicer.Sample(sample_request("C", 3), None)
        assert spans_from_pb(response.sequences[0].versions) == [VersionSpan(v(3), 0, MAX)]
        assert servicer.inflight.get(RUN).checkpoint_key == "C" and await set_target(servicer, "B", 2) == 3
        # another run's requests are not moved; a snapshot request reports its own weights
        response = await servicer.Sample(sample_request("A", 1, run="other"), None)
        assert spans_from_pb(response.sequences[0].versions) == [VersionSpan(v(1), 0, MAX)]
        snapshot = await servicer.Sample(sample_request("A", 0, run=""), None)
        assert spans_from_pb(snapshot.sequences[0].versions) == [VersionSpan(WeightsVersion("A", 0), 0, MAX)]
        base = await servicer.Sample(sample_request("", 0, run=""), None)
        assert spans_from_pb(base.sequences[0].versions) == [VersionSpan(WeightsVersion(), 0, MAX)]

    asyncio.run(scenario())


def test_set_inflight_target_refusals_change_nothing(servicer, folders):
    async def scenario():
        await push(servicer, "A", folders["A"])
        await push(servicer, "B", folders["B"])
        assert await set_target(servicer, "B", 2) == 2
        with pytest.raises(AdapterNotLoaded) as raised:
            await set_target(servicer, "never-pushed", 3)
        assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert raised.value.message.startswith("ADAPTER_NOT_LOADED: ")
        for run, key, version in [("", "A", 3), (RUN, "", 3), (RUN, "A", 0), (RUN, "A", -1)]:
            with pytest.raises(InvalidArgument) as refused:
                await set_target(servicer, key, version, run=run)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert await set_target(servicer, "A", 1) == 2   # older: ignored, the held version answered
        assert servicer.inflight.get(RUN).checkpoint_key == "B" and servicer.inflight.get(RUN).weights == v(2)
        with pytest.raises(InvalidArgument):   # an in-flight request names an in-flight version
            await servicer.Sample(sample_request("A", 0), None)
        assert servicer.residency.pins("A") == 0 and servicer.inflight.get(RUN).weights == v(2)

    asyncio.run(scenario())


def test_a_push_during_a_decode_is_installed_between_its_steps(servicer, folders, by_hand):
    """C, pushed while a base-model request decodes, is loaded before that decode ends. A push that
    replaces the adapter a running request decodes with (B's files under key A) waits for the batch:
    that request stays wholly on the old A, later requests get the new one."""
    pushed = threading.Event()

    async def scenario():
        await push(servicer, "A", folders["A"])
        queued_during_decode = []
        queued = lambda: wait_for(lambda: len(servicer._installs) > 0)  # noqa: E731
        gate = Gate(servicer.backend.loaded.model, {
            3: queued,                          # C's push is queued (installed after the next step)
            4: lambda: pushed.wait(WAIT),       # ... and its push has returned
            5: queued,                          # A's replacement is queued
            8: lambda: queued_during_decode.append(len(servicer._installs)) or True})
        try:
            task = asyncio.create_task(servicer.Sample(sample_request("A", 0, run=""), None))
            await until(gate.reached[3].is_set)
            await asyncio.wait_for(push(servicer, "C", folders["C"]), WAIT)
            assert not task.done() and "C" in servicer.backend.lora.adapters
            pushed.set()
            replacing = asyncio.create_task(push(servicer, "A", folders["B"]))
            response = await task
            await asyncio.wait_for(replacing, WAIT)
        finally:
            gate.close()
        assert gate.timed_out == [] and queued_during_decode == [1]   # still waiting 4 steps later
        seq = response.sequences[0]
        assert decode_tokens(seq.tokens).tolist() == by_hand(["A"] * MAX)[0]
        assert spans_from_pb(seq.versions) == [VersionSpan(WeightsVersion("A", 0), 0, MAX)]
        after = (await servicer.Sample(sample_request("A", 0, run=""), None)).sequences[0]
        assert decode_tokens(after.tokens).tolist() == by_hand(["B"] * MAX)[0]   # the new A is B's weights

    asyncio.run(scenario())
