"""Deterministic mode through the public API (issue 23, docs/deterministic.md) on the real stack: the
scheduler runs with TEMPER_SCHEDULER_DETERMINISTIC_RUNS=true, so a run or base-model sampling client
that does not say is deterministic (how the unmodified tinker SDK gets the mode) and one that says
False is not. Checked with numbers, not flags: a deterministic run trained while other tenants'
requests of other lengths share its cycles equals the same run trained alone, bit for bit; the
logprobs its checkpoint's sampler reports for sampled tokens, and compute_logprobs, are the trainer's
forward logprobs exactly; the tinker SDK through the gateway sees the same."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fixtures_stack import sft_datum
from temper.client import AdamParams, ModelInput, SamplingParams
from temper.localstack import LocalStack

ADAM = AdamParams(learning_rate=1e-2, eps=1e-8)
DATA = [[5, 17, 42, 9, 77, 3, 18], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
OTHERS = [[7, 8, 9] * 13, [40, 41] * 3, list(range(100, 190))]  # other tenants' lengths, sharing the cycles


@pytest.fixture(scope="module")
def det_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_deterministic")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("deterministic"), database_url=url, num_threads=1, gateway=True,
                    extra_env={"TEMPER_SCHEDULER_DETERMINISTIC_RUNS": "true"}) as local:
        local.start()
        yield local


def train(run, steps: int = 2) -> list:
    """``steps`` forward_backward + optim_step, each pair submitted before waiting; the answers."""
    outs = []
    for _ in range(steps):
        fb, opt = run.forward_backward([sft_datum(t) for t in DATA], "cross_entropy"), run.optim_step(ADAM)
        outs.append(fb.result())
        opt.result()
    return outs


def same_outputs(a, b) -> None:
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        assert np.array_equal(x["logprobs"].to_numpy(), y["logprobs"].to_numpy())


def test_the_mode_is_shown_and_defaults_to_the_setting(det_stack, tiny_model_dir):
    with det_stack.client() as client:
        unset = client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
        off = client.create_lora_training_client(tiny_model_dir, rank=4, seed=1, deterministic=False)
        assert unset.get_info().deterministic is True and off.get_info().deterministic is False
        assert client.create_sampling_client(base_model=tiny_model_dir).result().deterministic is True
        assert client.create_sampling_client(base_model=tiny_model_dir, deterministic=False).result().deterministic is False
        # a deterministic run's checkpoint samples deterministically whatever the request says
        path = unset.save_weights_for_sampler("shown").result().path
        assert client.create_sampling_client(model_path=path, deterministic=False).result().deterministic is True
        path = off.save_weights_for_sampler("shown").result().path
        assert client.create_sampling_client(model_path=path).result().deterministic is False


def test_cobatched_equals_solo_through_the_scheduler(det_stack, tiny_model_dir):
    with det_stack.client() as client:
        alone = train(client.create_lora_training_client(tiny_model_dir, rank=4, seed=7))
    with det_stack.client() as mine, det_stack.client("det-others") as others:
        runs = [others.create_lora_training_client(tiny_model_dir, rank=4, seed=8, deterministic=False) for _ in OTHERS]
        shared = mine.create_lora_training_client(tiny_model_dir, rank=4, seed=7)
        with ThreadPoolExecutor(len(runs)) as pool:  # the other tenants keep the trainer's cycles full meanwhile
            busy = [pool.submit(lambda r=r, t=t: [r.forward_backward([sft_datum(t)] * 3, "cross_entropy").result()
                                                  for _ in range(4)]) for r, t in zip(runs, OTHERS)]
            together = train(shared)
            for f in busy:
                f.result()
    for a, b in zip(alone, together, strict=True):
        same_outputs(a, b)


def test_sampled_and_scored_logprobs_are_the_trainers(det_stack, tiny_model_dir):
    with det_stack.client() as client, det_stack.client("det-sampling-other") as other:
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=3)
        train(run, 1)
        sampler = run.save_weights_and_get_sampling_client("det")
        busy = other.create_sampling_client(base_model=tiny_model_dir, deterministic=False)
        prompts = [DATA[0], DATA[1], list(range(30, 100))]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
        noise = [busy.sample(ModelInput.from_ints(p[:4]), 2, params) for p in prompts]  # default requests in the same batches
        futures = [sampler.sample(ModelInput.from_ints(p), 2, params) for p in prompts]
        for prompt, future in zip(prompts, futures):
            for seq in future.result().sequences:
                tokens = prompt + list(seq.tokens)
                want = run.forward([sft_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
                assert np.array_equal(np.asarray(seq.logprobs, np.float32), want[len(prompt) - 1:])
                scored = sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()
                assert np.array_equal(np.asarray(scored[1:], np.float32), want)
        for f in noise:
            f.result()
        # and again, alone: the same tokens and the same bits
        again = sampler.sample(ModelInput.from_ints(prompts[2]), 2, params).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in futures[2].result().sequences]
        assert [s.logprobs for s in again.sequences] == [s.logprobs for s in futures[2].result().sequences]


def test_the_tinker_sdk_gets_the_mode_by_default(det_stack, tiny_model_dir):
    tinker = pytest.importorskip("tinker")  # the gateway extra (make venv installs it)
    from tinker import types as tt

    sdk = tinker.ServiceClient(base_url=det_stack.gateway_url, api_key=det_stack.api_key)
    try:
        tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=9).result()
        sc = tc.save_weights_and_get_sampling_client().result()
        prompt = DATA[1]
        got = sc.sample(tt.ModelInput.from_ints(prompt), num_samples=2,
                        sampling_params=tt.SamplingParams(max_tokens=5, temperature=1.0, seed=2)).result()
        for seq in got.sequences:
            tokens = prompt + list(seq.tokens)
            datum = tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(len(tokens) - 1, np.float32)})
            want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            assert np.array_equal(np.asarray(seq.logprobs, np.float32), want[len(prompt) - 1:])
    finally:
        sdk.close("success")
