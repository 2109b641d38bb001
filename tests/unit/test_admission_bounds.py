"""Input the scheduler must refuse itself, before it claims, writes or calls anything: seq_ids far
ahead (a gap skip would push next_seq_id past a BIGINT), a run_index past the session counter's
INTEGER, user metadata of a new session, a checkpoint of another LoRA layout, a deeply nested
adapter config; and sampling requests the sampler would refuse (checked before any adapter push or
checkpoint touch)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from fakes_scheduler import FakeBackends, FakeTrainer, build, fb
from temper.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from temper.scheduler.planning.admission import MAX_SEQ_AHEAD
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.scheduler.api.import_verbs import adapter_base_model
from temper.scheduler.api.sampling_verbs import SamplingVerbs
from temper.scheduler.api.servicer import TemperServicer
from temper.v1 import sampler_pb2, service_pb2, types_pb2


@contextlib.asynccontextmanager
async def started(runs: dict[str, str], trainer: FakeTrainer | None = None, **kwargs):
    s = build(trainer=trainer, **kwargs)
    for run_id, tenant in runs.items():
        s.store.add_run(run_id, tenant)
    servicer = TemperServicer(s.store, FakeBackends(s.trainer), s.admission.runs, s.admission)
    task = asyncio.create_task(s.loop.run_forever())
    token = set_caller("alice")
    try:
        yield s, servicer
    finally:
        reset_caller(token)
        task.cancel()


def nothing_claimed(s, run_id: str) -> bool:
    queue = s.admission.queues.get(run_id)
    return (not s.admission.recent and not s.store.requests and (queue is None or not queue.pending))


def test_seq_ids_near_a_bigint_or_far_ahead_are_refused_before_anything_is_claimed():
    async def main():
        async with started({"r": "alice"}) as (s, api):
            for seq in (2**63 - 1, 2**62, MAX_SEQ_AHEAD + 2):
                with pytest.raises(InvalidArgument, match="seq_id"):
                    await api.ForwardBackward(fb("r", seq), None)
                assert nothing_claimed(s, "r")
            assert (await api.ForwardBackward(fb("r", 1), None)).metrics["loss:sum"] == 1.0  # the run goes on

    asyncio.run(main())


def test_a_seq_past_what_a_run_may_hold_waits_for_its_resend_and_parking_within_it_works():
    async def main():
        async with started({"r": "alice"}, max_queued_per_run=4) as (s, api):
            with pytest.raises(ResourceExhausted, match="ahead"):  # backpressure: the client resends it
                await api.ForwardBackward(fb("r", 6), None)
            assert nothing_claimed(s, "r")
            parked = asyncio.create_task(api.ForwardBackward(fb("r", 5), None))  # 4 ahead of seq 1: waits
            await asyncio.sleep(0.1)
            assert not parked.done()
            await api.ForwardBackward(fb("r", 1), None)
            resent = asyncio.create_task(api.ForwardBackward(fb("r", 6), None))  # now 4 ahead of seq 2: admitted
            for seq in (2, 3, 4):
                await api.ForwardBackward(fb("r", seq), None)
            assert [(await t).metrics["loss:sum"] for t in (parked, resent)] == [5.0, 6.0]
            assert s.trainer.applied == [("r", seq) for seq in range(1, 7)]

    asyncio.run(main())


def test_run_index_and_session_metadata_are_checked_before_the_database():
    async def main():
        async with started({}) as (s, api):
            for index in (2**31 - 1, 2**63 - 1, -1):
                request = service_pb2.CreateTrainingRunRequest(session_id="s", base_model="fake-model", run_index=index,
                                                               lora_config=types_pb2.LoraConfig(rank=4, train_mlp=True))
                with pytest.raises(InvalidArgument, match="run_index"):
                    await api.CreateTrainingRun(request, None)
            with pytest.raises(InvalidArgument, match="user_metadata"):
                await api.CreateSession(service_pb2.CreateSessionRequest(user_metadata={f"k{i}": "v" for i in range(100)}), None)
            with pytest.raises(InvalidArgument, match="user_metadata"):
                await api.CreateSession(service_pb2.CreateSessionRequest(user_metadata={"k": "v" * 5000}), None)

    asyncio.run(main())


def test_a_checkpoint_of_another_lora_layout_is_refused_at_admission_with_no_row():
    async def main():
        trainer = FakeTrainer(adapters={"r": [], "src": [], "same": []})
        async with started({"r": "alice", "src": "alice", "same": "alice"}, trainer=trainer) as (s, api):
            s.store.runs["src"].lora_rank = 8
            s.store.runs["same"].train_unembed = False
            s.store.readable_checkpoint = lambda path, tenant: SimpleNamespace(training_run_id=path.split("/")[2])
            with pytest.raises(FailedPrecondition, match="rank 8"):
                await api.LoadWeights(service_pb2.LoadWeightsRequest(training_run_id="r", seq_id=1, path="tinker://src/weights/a"), None)
            assert ("r", 1) not in s.store.requests and trainer.adapters["r"] == []
            s.store.runs["r"].train_mlp = False
            with pytest.raises(FailedPrecondition, match="attention on|attention\\+MLP"):
                await api.LoadWeights(service_pb2.LoadWeightsRequest(training_run_id="r", seq_id=2, path="tinker://same/weights/a"), None)
            assert ("r", 2) not in s.store.requests
            s.store.runs["r"].train_mlp = True
            await api.LoadWeights(service_pb2.LoadWeightsRequest(training_run_id="r", seq_id=3, path="tinker://same/weights/a"), None)
            assert trainer.adapters["r"] == [("load", "same/weights/a")]

    asyncio.run(main())


@pytest.mark.parametrize("config", [b"[" * 100_000, b'{"base_model_name_or_path": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                    b'{"base_model_name_or_path": "' + b"m" * 70_000 + b'"}'])
def test_an_adapter_config_too_deep_or_too_big_is_refused_before_parsing(config):
    with pytest.raises(InvalidArgument) as err:
        adapter_base_model(config)
    assert len(err.value.message) < 200


class _Sampling(SamplingVerbs):
    """The sampling verbs over fakes that record what was touched and called."""

    def __init__(self):
        self.touched, self.calls = [], []
        row = SimpleNamespace(session_id="s", base_model="m", model_path="tinker://r/sampler_weights/a", deterministic=False,
                              inflight_run_id=None, min_version=None)
        info = sampler_pb2.SamplerModelInfo(base_model="m", vocab_size=100, max_context_length=64)

        async def call_samplers(base_model, method, request, load=None):
            self.calls.append(method)
            return types_pb2.SampleResponse() if method == "Sample" else sampler_pb2.ComputeLogprobsResponseInternal()

        async def wait_ready():
            return None

        async def no_wait(tenant):
            return None

        async def served(role, base_model):
            return None

        self.store = SimpleNamespace(get_sampling_client=lambda sampler_id, tenant: (row, "alice", False),
                                     readable_checkpoint=lambda path, tenant: None, touch_checkpoint=self.touched.append,
                                     record_sampling=lambda rows: None,
                                     read_access=SimpleNamespace(may_read=lambda path, tenant: True))
        self.backends = SimpleNamespace(wait_ready=wait_ready, served=served, sampler_info=lambda base: info,
                                        holds=lambda base, key: True, call_samplers=call_samplers)
        self.admission = SimpleNamespace(quotas=SimpleNamespace(wait_to_sample=no_wait, sampled=SimpleNamespace(record=lambda t, n: None)))
        self._closed_sessions = set()
        self._init_sampling()


PROMPT = types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=b"\x01\x00\x00\x00" * 3))])


@pytest.mark.parametrize("changes", [
    dict(num_samples=0), dict(num_samples=65), dict(topk_logprobs=-1), dict(topk_logprobs=101),
    dict(sampling_params=types_pb2.SamplingParams(max_tokens=0)),
    dict(sampling_params=types_pb2.SamplingParams(max_tokens=4, temperature=float("nan"))),
    dict(sampling_params=types_pb2.SamplingParams(max_tokens=4, top_p=float("nan"))),
    dict(sampling_params=types_pb2.SamplingParams(max_tokens=4, stop_strings=[""])),
    dict(prompt=types_pb2.ModelInput()),
])
def test_a_bad_sample_request_calls_no_sampler_and_touches_no_checkpoint(changes):
    verbs = _Sampling()
    fields = {"sampler_id": "s:sample:0", "prompt": PROMPT, "num_samples": 1, "sampling_params": types_pb2.SamplingParams(max_tokens=4)}
    token = set_caller("alice")
    try:
        with pytest.raises(InvalidArgument):
            asyncio.run(verbs.Sample(service_pb2.SampleRequest(**{**fields, **changes}), None))
        assert verbs.touched == [] and verbs.calls == []
        asyncio.run(verbs.Sample(service_pb2.SampleRequest(**fields), None))
        assert verbs.touched == ["tinker://r/sampler_weights/a"] and verbs.calls == ["Sample"]
    finally:
        reset_caller(token)


def test_compute_logprobs_touches_its_checkpoint_only_once_accepted():
    verbs = _Sampling()
    token = set_caller("alice")
    try:
        with pytest.raises(InvalidArgument, match="last_n"):
            asyncio.run(verbs.ComputeLogprobs(service_pb2.ComputeLogprobsRequest(sampler_id="s:sample:0", prompt=PROMPT,
                                                                                 prompt_logprobs_last_n=50), None))
        assert verbs.touched == [] and verbs.calls == []
        asyncio.run(verbs.ComputeLogprobs(service_pb2.ComputeLogprobsRequest(sampler_id="s:sample:0", prompt=PROMPT), None))
        assert verbs.touched == ["tinker://r/sampler_weights/a"] and verbs.calls == ["ComputeLogprobs"]
    finally:
        reset_caller(token)
