"""A Postgres outage during an in-flight save and in-flight sampling (issue 31, "Bad input and faults"), on
the real stack with the database behind test_faults.py's FlakyProxy (refuses connections while down).

Saves: one in-flight save reaches the trainer, the database goes away, the trainer writes its files: the
checkpoint row and the run's move to it (one transaction) wait for the database, so the save is answered
only after it is back, as the next version (2); a second in-flight save sent during the outage is admitted
once it is back (the client resends UNAVAILABLE) and becomes version 3. No version is skipped, none is
given twice, no answer comes early, and the run's target moves only then (GetInfo, the stored rows, and
the sampler itself, which a request naming version 1 shows still holds version 1 as the run's target).

Sampling, during the outage, on the run's current target (version 1, known to the scheduler: the client
row and target cached, the path touched just before): the scheduler still sends each request to the
sampler on version 1, the only committed target (its in-memory target moves only after the save's
transaction), and the sampler decodes it (its request count rises by as many), but the answer waits on
the sampling record's commit (the group commit of sampling rows and counters, planning/records.py), which
the outage fails: every caller is answered UNAVAILABLE (retryable; the client resends it), never a wrong
version. (Measured: 46 of 46 UNAVAILABLE in 3 s.) A sample answered OK then, one whose record went in just
before the database went down, would have to name version 1 only. Once the database is back, sampling
goes on and reaches version 3."""

from __future__ import annotations

import time

import grpc
from sqlalchemy import create_engine, text

from fixtures_stack import raw_stub, request_rows, sft_datum
from test_faults import FlakyProxy, metric, start_stack, tcp_upstream, wait_until
from temper.client import AdamParams, ModelInput, SamplingParams, WeightsVersion, convert
from temper.common.auth import bearer_metadata
from temper.common.checkpoints import parse_path
from temper.common.codec import encode_tokens
from temper.v1 import sampler_pb2, sampler_pb2_grpc, service_pb2, types_pb2

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
PROMPT = [3, 14, 15, 92]
PARAMS = SamplingParams(max_tokens=4, temperature=1.0, stop=[])
LR = AdamParams(learning_rate=5e-2)
OUTAGE = 3.0  # seconds


def train(run) -> None:
    run.forward_backward([sft_datum(PATTERN)]).result(timeout=120)
    run.optim_step(LR).result(timeout=120)


def target(stack, run_id: str) -> WeightsVersion:
    info = raw_stub(stack).GetInfo(service_pb2.GetInfoRequest(training_run_id=run_id), timeout=30)
    return WeightsVersion(info.inflight.path, info.inflight.version)


def stored_versions(url: str, run_id: str) -> list[tuple[int, str]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("select inflight_version, path from checkpoints where training_run_id = :r "
                                 "and inflight_version is not null order by inflight_version"), {"r": run_id}).all()
    engine.dispose()
    return [(int(version), path) for version, path in rows]


def raw_sample(stub, sampler_id: str, pin: bool) -> service_pb2.SampleResponse:
    """One Sample without the client's retries: the scheduler's own answer."""
    return stub.Sample(service_pb2.SampleRequest(
        sampler_id=sampler_id, prompt=convert.model_input_to_proto(ModelInput.from_ints(PROMPT)), num_samples=2,
        sampling_params=types_pb2.SamplingParams(max_tokens=PARAMS.max_tokens, temperature=1.0), pin_version=pin),
        timeout=30)


def sampler_target(stack, run_id: str, v1: WeightsVersion) -> set[tuple[str, int]]:
    """What the sampler itself holds as the run's target: a request naming version 1 of the run starts on
    the newest version the sampler was told of (docs/async_rl.md)."""
    with grpc.insecure_channel(stack.service("sampler").address) as channel:
        response = sampler_pb2_grpc.SamplerStub(channel).Sample(sampler_pb2.SamplerSampleRequest(
            checkpoint_key=parse_path(v1.path).key, prompt_tokens=encode_tokens(PROMPT), num_samples=1,
            inflight_run=run_id, weights=types_pb2.WeightsVersion(path=v1.path, version=v1.version),
            sampling_params=types_pb2.SamplingParams(max_tokens=2, temperature=1.0)),
            metadata=[bearer_metadata(stack.internal_token)], timeout=30)
    return versions(response)


def versions(response) -> set[tuple[str, int]]:
    """(path, version) of every span, after checking the spans cover each sequence's tokens in order."""
    seen = set()
    for s in response.sequences:
        assert [sp.first_token for sp in s.versions] == [sum(x.count for x in s.versions[:k]) for k in range(len(s.versions))]
        assert sum(sp.count for sp in s.versions) == len(s.tokens) // 4 > 0
        seen |= {(sp.weights.path, sp.weights.version) for sp in s.versions}
    return seen


def test_a_database_outage_holds_inflight_saves_and_never_misattributes_samples(tiny_model_dir, new_postgres_database,
                                                                                 tmp_path):
    real_url = new_postgres_database("temper_inflight_outage")
    with FlakyProxy(tcp_upstream(real_url)) as proxy, \
            start_stack(tiny_model_dir, proxy.url(real_url), tmp_path / "stack") as stack, stack.client() as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=71)
        train(run)
        follower = run.save_weights_and_get_sampling_client(kind="inflight").result(timeout=120)
        v1 = target(stack, run.model_id)
        assert v1.version == 1
        stub = raw_stub(stack)
        for pin in (False, True):  # the client row cached, the target path touched: what sampling needs is known
            assert versions(raw_sample(stub, follower.sampler_id, pin)) == {(v1.path, 1)}
        train(run)

        stack.pause("trainer")  # the save below reaches the trainer and waits there
        try:
            first = run.save_weights_inflight()
            wait_until(lambda: request_rows(real_url, run.model_id)[-1][1:] == ("save_weights", "running"), 30,
                       "the in-flight save on the trainer")
            proxy.down()
            went_down = time.monotonic()
        finally:
            stack.resume("trainer")  # it writes the files; the row and the target wait for the database
        second = run.save_weights_inflight()  # sent during the outage
        sampled_before = metric(stack.service("sampler"), "temper_sampler_sample_seconds_count")
        answers: dict[str, int] = {}
        i = 0
        while time.monotonic() < went_down + OUTAGE:
            assert not first.done() and not second.done()  # never answered early
            try:
                seen = versions(raw_sample(stub, follower.sampler_id, pin=i % 2 == 0))
                assert seen == {(v1.path, 1)}, seen  # the unfinished save is never sampled from
                answers["OK"] = answers.get("OK", 0) + 1
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
                answers["UNAVAILABLE"] = answers.get("UNAVAILABLE", 0) + 1
            i += 1
            time.sleep(0.05)
        assert not first.done() and not second.done()
        sampled_during = metric(stack.service("sampler"), "temper_sampler_sample_seconds_count") - sampled_before
        assert sampled_during >= sum(answers.values()) >= 3  # each reached the sampler: only its record waited
        assert stored_versions(real_url, run.model_id) == [(1, v1.path)]  # nothing half-written
        assert sampler_target(stack, run.model_id, v1) == {(v1.path, 1)}  # the samplers were not told of v2 either
        proxy.up()
        came_up = time.monotonic()

        v2, v3 = first.result(timeout=60), second.result(timeout=60)
        answered = time.monotonic() - came_up
        assert (v2.version, v3.version) == (2, 3)  # the next versions, in the order sent: no gap, no repeat
        assert len({v1.path, v2.path, v3.path}) == 3
        assert stored_versions(real_url, run.model_id) == [(1, v1.path), (2, v2.path), (3, v3.path)]
        assert target(stack, run.model_id) == v3
        # sampling goes on after the outage, and reaches the newest target
        wait_until(lambda: versions(raw_sample(stub, follower.sampler_id, pin=True)) == {(v3.path, 3)}, 30,
                   "samples on version 3")
        assert sampler_target(stack, run.model_id, v1) == {(v3.path, 3)}  # the probe sees a newer target
        got = follower.sample(ModelInput.from_ints(PROMPT), 1, PARAMS).result(timeout=60)
        assert {s.version for s in got.sequences[0].versions} == {3}
        train(run)
        v4 = run.save_weights_inflight().result(timeout=60)
        assert v4.version == 4 and target(stack, run.model_id) == v4
        print(f"\nin-flight outage {OUTAGE:.0f} s: samples during it {answers}, {sampled_during:.0f} on the sampler; "
              f"both saves answered within {answered:.1f} s after it ended")
