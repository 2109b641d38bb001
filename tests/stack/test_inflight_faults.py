"""Faults under an in-flight load (issue 31, "Bad input and faults"), on the real stack and Postgres:
a thread samples continuously from an in-flight client while the test trains and saves in-flight
versions. (a) The trainer is SIGKILLed in the middle of an in-flight save: the target stays at the last
durable version while the save is unfinished, no sample names a version that was not saved, and after
recovery the versions go on one after the other. (b) A sampler is SIGKILLed right after a save (its
update in flight) and restarted: sampling goes on, on the newest target.

Attribution, in both: each sampled sequence's spans cover its tokens in order and name only
(path, version) pairs the run's checkpoint rows hold (GetCheckpoint finds each path); the tokens of a
sequence's first span (all of them when pinned) have the logprobs a snapshot client on that span's path
computes for the same prompt and tokens, within 1e-4, while the versions' weights differ by far more
than that: no token is attributed to weights other than the ones that produced it. (A sampler killed
without load, and a scheduler restart, are in test_inflight_weights.py.)

Float32 limit of that comparison: the sampler's logprobs come from a KV-cached decode step, a snapshot's
from one forward over the whole sequence, and the two round differently (~1e-7). The trained tiny
model's last layer amplifies that at a few (prompt, tokens) positions: measured offline on one run's
four saved versions with the sampler backend alone (no stack, no retarget, no install, prefix cache on
or off), 0-2% of sequences have ONE position off by 1e-4 to 5.9e-3, the rest within 1e-5; with the
model and LoRA math in float64 the two agree exactly. On the stack both cases show it (up to ~3%). Such a sequence is held to OUTLIER_ATOL and must
still be far nearer its named version than any other saved version (``assert_attributed``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import raw_stub, request_rows, sft_datum
from temper.client import AdamParams, ModelInput, SamplingParams, WeightsVersion
from temper.localstack import LocalStack
from temper.v1 import service_pb2

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
PROMPTS = [[3, 14, 15, 92], [2, 71, 82, 81, 82], [11, 22, 33]]
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, stop=[])  # temperature 1: sampled logprobs are the model's
LR = AdamParams(learning_rate=5e-2)
OUTLIER_ATOL = 1e-2  # float32 cached-decode vs one-pass scoring at an ill-conditioned position (module docstring)
MARGIN = 10          # ... and then every other saved version must be this many times farther off (measured: >1000)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_inflight_faults")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("inflight_faults"), database_url=url, num_threads=1,
                    num_samplers=2) as local:
        local.address = local.start()
        local.url = url
        yield local


class Load:
    """Samples from ``follower`` in a thread until stopped, pinned and unpinned in turn; keeps every
    (prompt, pinned, sequence, answered-at) and every error."""

    def __init__(self, follower):
        self.follower, self.records, self.errors = follower, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            prompt, pinned = PROMPTS[i % len(PROMPTS)], i % 2 == 0
            i += 1
            try:
                got = self.follower.sample(ModelInput.from_ints(prompt), 2, PARAMS, pin_version=pinned).result(timeout=120)
                self.records += [(prompt, pinned, s, time.monotonic()) for s in got.sequences]
            except Exception as exc:  # noqa: BLE001 - kept and judged by the test
                self.errors.append((time.monotonic(), exc))

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.records):
            assert time.monotonic() < deadline and self._thread.is_alive(), f"timed out waiting for {what}; errors {self.errors[-3:]}"
            time.sleep(0.05)


def train(run, steps: int = 1) -> None:
    for _ in range(steps):
        run.forward_backward([sft_datum(PATTERN)]).result(timeout=300)
        run.optim_step(LR).result(timeout=300)


def target(stack, run_id: str) -> WeightsVersion:
    info = raw_stub(stack).GetInfo(service_pb2.GetInfoRequest(training_run_id=run_id), timeout=60)
    return WeightsVersion(info.inflight.path, info.inflight.version)


def stored_versions(url: str, run_id: str) -> set[WeightsVersion]:
    """The run's in-flight checkpoint rows (ephemeral, so not in its listing)."""
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("select path, inflight_version from checkpoints where training_run_id = :r "
                                 "and inflight_version is not null"), {"r": run_id}).all()
    engine.dispose()
    return {WeightsVersion(path, int(version)) for path, version in rows}


def newest_seen(records) -> int:
    return max((span.version for _, _, s, _ in records for span in s.versions), default=0)


def assert_attributed(stack, client, records, saved: set[WeightsVersion], atol: float = 1e-4) -> None:
    """Spans cover the tokens in order and name saved versions only; each first span's (a pinned
    sequence's whole) logprobs are those of a snapshot client on its path within ``atol``, and another
    version would give logprobs farther off than that. A first span off by more (float32 rounding
    amplified at one position: module docstring) must be within OUTLIER_ATOL and its named version must
    be the nearest saved one by MARGIN times: no token is attributed to another version either way."""
    assert records
    stored = stored_versions(stack.url, next(iter(saved)).path.split("/")[2])
    assert saved <= stored, (saved, stored)
    for path in {w.path for w in saved}:
        raw_stub(stack).GetCheckpoint(service_pb2.GetCheckpointRequest(path=path), timeout=60)  # NOT_FOUND would raise
    snapshots, scores, distinct, outliers = {}, {}, 0, 0

    def score(path: str, tokens: list[int]) -> np.ndarray:
        if (path, tuple(tokens)) not in scores:
            snapshot = snapshots.setdefault(path, client.create_sampling_client(model_path=path))
            scores[path, tuple(tokens)] = np.asarray(snapshot.compute_logprobs(ModelInput.from_ints(tokens)).result(timeout=120))
        return scores[path, tuple(tokens)]

    for prompt, pinned, sequence, _ in records:
        spans = sequence.versions
        assert [s.first_token for s in spans] == [sum(s.count for s in spans[:k]) for k in range(len(spans))]
        assert sum(s.count for s in spans) == len(sequence.tokens) == len(sequence.logprobs) and all(s.count > 0 for s in spans)
        assert {s.weights for s in spans} <= saved, spans
        assert [s.version for s in spans] == sorted({s.version for s in spans})  # never backwards within a sequence
        if pinned:
            assert len(spans) == 1, spans
        first, tokens = spans[0], prompt + sequence.tokens[:spans[0].count]
        got = np.asarray(sequence.logprobs[:first.count])
        off = np.abs(score(first.path, tokens)[len(prompt):] - got).max()
        if off > atol:
            others = {w.version: np.abs(score(w.path, tokens)[len(prompt):] - got).max() for w in saved if w != first.weights}
            assert off <= OUTLIER_ATOL and all(o > MARGIN * off for o in others.values()), (first, off, others)
            outliers += 1
        other = next((w for w in sorted(saved, key=lambda w: w.version) if w.version != first.version), None)
        if pinned and other is not None and distinct < 3:  # the check tells versions apart
            wrong = score(other.path, prompt + sequence.tokens)
            distinct += np.abs(np.subtract(wrong[len(prompt):], sequence.logprobs)).max() > 10 * atol
    assert distinct >= 1
    assert outliers <= max(1, len(records) // 20), (outliers, len(records))  # rare (measured <= 3%), not the rule


def test_a_trainer_killed_mid_inflight_save_leaves_the_last_durable_target_and_versions_go_on(stack, tiny_model_dir):
    with stack.client() as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=61)
        train(run)
        follower = run.save_weights_and_get_sampling_client(kind="inflight").result(timeout=300)
        saved = {target(stack, run.model_id)}
        with Load(follower) as load:
            train(run, 2)
            v2 = run.save_weights_inflight().result(timeout=300)
            saved.add(v2)
            load.wait_for(lambda r: newest_seen(r) == 2, 120, "samples on version 2")
            train(run, 2)
            stack.pause("trainer")  # the save below reaches the trainer and gets no answer
            try:
                pending = run.save_weights_inflight()
                deadline = time.monotonic() + 30
                while request_rows(stack.url, run.model_id)[-1][1:] != ("save_weights", "running"):
                    assert time.monotonic() < deadline, request_rows(stack.url, run.model_id)
                    time.sleep(0.05)
                assert target(stack, run.model_id) == v2  # mid-save: the last durable version
                stack.service("trainer").process.kill()  # SIGKILL in the middle of the save
                stack.service("trainer").process.wait(timeout=30)
            finally:
                stack.resume("trainer")
            killed_at, before = time.monotonic(), len(load.records)
            load.wait_for(lambda r: len(r) >= before + 4, 60, "samples while the trainer is dead")
            assert target(stack, run.model_id) == v2 and not pending.done()
            stack.restart("trainer", crash=True)  # same port, a new process without the run's adapter
            v3 = pending.result(timeout=300)  # held, the run restored, the save sent again: written once
            assert v3.version == 3 and v3.path != v2.path and target(stack, run.model_id) == v3
            saved.add(v3)
            train(run)
            v4 = run.save_weights_inflight().result(timeout=300)
            assert v4.version == 4 and target(stack, run.model_id) == v4  # none skipped, none twice
            saved.add(v4)
            load.wait_for(lambda r: newest_seen(r) == 4, 120, "samples on version 4")
        assert not load.errors, load.errors[:3]  # the samplers never needed the trainer that died
        assert stored_versions(stack.url, run.model_id) == saved
        assert all(s.versions[0].version <= 2 for _, _, s, at in load.records if at < killed_at)
        assert_attributed(stack, client, load.records, saved)


def test_a_sampler_killed_mid_update_under_load_comes_back_on_the_newest_target(stack, tiny_model_dir):
    with stack.client() as client:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=62)
        train(run)
        follower = run.save_weights_and_get_sampling_client(kind="inflight").result(timeout=300)
        saved = {target(stack, run.model_id)}
        with Load(follower) as load:
            load.wait_for(lambda r: len(r) >= 4, 60, "samples on version 1")
            train(run, 2)
            v2 = run.save_weights_inflight().result(timeout=300)  # answered; its spread to the samplers under way
            saved.add(v2)
            stack.restart("sampler", crash=True)  # SIGKILL while it loads (or is about to load) version 2
            restarted = time.monotonic()
            load.wait_for(lambda r: any(at > restarted for *_, at in r) and newest_seen(r) == 2, 120, "samples on version 2")
            train(run, 2)
            v3 = run.save_weights_inflight().result(timeout=300)
            saved.add(v3)
            load.wait_for(lambda r: newest_seen(r) == 3, 120, "samples on version 3")
            settled = len(load.records)
            load.wait_for(lambda r: len(r) >= settled + 6, 60, "more samples after version 3")
        after = [s for _, _, s, _ in load.records[settled:]]
        assert all(span.version == 3 for s in after for span in s.versions)  # the newest target, on both samplers
        assert all(at < restarted + 60 for at, _ in load.errors), load.errors[:3]  # failures only around the kill
        assert_attributed(stack, client, load.records, saved)
