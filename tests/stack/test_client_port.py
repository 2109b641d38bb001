"""A Tinker script runs on temper.client by changing only its imports.

The scripts below are written for the official SDK in the style of the cookbook's sl_loop (no
renderer: token ids directly). The test rewrites their import lines, and nothing else, and runs them
against the local stack on the tiny model: an SFT loop (forward_backward / optim_step / save_state /
resume / checkpoint listing / sampling) and an RL loop (sampling + importance_sampling, sync and
async, creation results used both as futures and as clients). The environment is a Tinker user's:
TINKER_BASE_URL (here the scheduler's gRPC address) and TINKER_API_KEY."""

import re

import numpy as np
import pytest

from temper.client.tokenizer import cache_folder, load_tokenizer

SFT_SCRIPT = '''
import numpy as np
import tinker
from tinker import types

SEQUENCES = [[5, 17, 42, 9, 77, 3, 18], [11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 40, 41, 40, 41]]


def make_datum(tokens):
    # lists, as cookbook code often passes them: target_tokens become int64, weights float32
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1] * (len(tokens) - 1)})


def mean_nll(result, batch):
    logprobs = np.concatenate([out["logprobs"].to_numpy() for out in result.loss_fn_outputs])
    weights = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in batch])
    return float(-(logprobs * weights).sum() / weights.sum())


def main(base_model, steps=6):
    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    batch = [make_datum(s) for s in SEQUENCES]
    losses, state_path = [], None
    for step in range(steps):
        adam_params = tinker.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_step_future = training_client.optim_step(adam_params)
        losses.append(mean_nll(fwd_bwd_future.result(), batch))
        optim_step_future.result()
        if step == 2:
            state_path = training_client.save_state(name="step-3", ttl_seconds=3600).result().path
    after = mean_nll(training_client.forward(batch, loss_fn="cross_entropy").result(), batch)

    resumed = service_client.create_training_client_from_state_with_optimizer(state_path).result()
    resumed_loss = mean_nll(resumed.forward(batch, loss_fn="cross_entropy").result(), batch)
    training_client.load_state(state_path).result()
    reloaded_loss = mean_nll(training_client.forward(batch, loss_fn="cross_entropy").result(), batch)

    sampler_path = training_client.save_weights_for_sampler(name="final").result().path
    rest_client = service_client.create_rest_client()
    checkpoints = rest_client.list_checkpoints(training_client.model_id).result().checkpoints
    run = rest_client.get_training_run(training_client.model_id).result()
    user_checkpoints = rest_client.list_user_checkpoints(limit=100).result()
    rest_client.set_checkpoint_ttl_from_tinker_path(sampler_path, 7200).result()
    rest_client.publish_checkpoint_from_tinker_path(sampler_path).result()

    sampling_client = service_client.create_sampling_client(model_path=sampler_path).result()
    sample = sampling_client.sample(prompt=types.ModelInput.from_ints(SEQUENCES[0][:3]), num_samples=2,
                                    sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)).result()
    service_client.close()
    return dict(losses=losses, after=after, state_path=state_path, resumed_loss=resumed_loss, reloaded_loss=reloaded_loss,
                step3_loss=losses[3], checkpoints=[c.tinker_path for c in checkpoints], run=run,
                user_checkpoints=[c.tinker_path for c in user_checkpoints.checkpoints], sample=sample,
                sampler_path=sampler_path)
'''

RL_SCRIPT = '''
import asyncio

import numpy as np
import tinker
from tinker import types

PROMPT = [5, 17, 42, 9]
GOOD = 7  # the reward: how often the completion says token 7


def datums(result):
    rewards = np.array([sum(t == GOOD for t in seq.tokens) for seq in result.sequences], dtype=np.float32)
    advantages = rewards - rewards.mean()
    data = []
    for seq, advantage in zip(result.sequences, advantages):
        tokens = PROMPT + seq.tokens
        n = len(PROMPT) - 1
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * n + list(seq.logprobs),
                            "advantages": [0] * n + [float(advantage)] * len(seq.tokens)}))
    return data


def main(base_model, iterations=2):
    service_client = tinker.ServiceClient()
    # the SDK's back-compat: the creation future used as the client itself
    training_client = service_client.create_lora_training_client(base_model, rank=4, seed=1)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    metrics = []
    for _ in range(iterations):
        sampling_client = training_client.save_weights_and_get_sampling_client()
        result = sampling_client.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params).result()
        fwd_bwd = training_client.forward_backward(datums(result), loss_fn="importance_sampling")
        optim = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
        metrics.append(fwd_bwd.result().metrics)
        optim.result()
    on_policy = asyncio.run(async_iteration(service_client, training_client, params))
    service_client.close()
    return dict(metrics=metrics, on_policy=on_policy, model_id=training_client.model_id)


async def async_iteration(service_client, training_client, params):
    sampling_client = await training_client.save_weights_and_get_sampling_client()
    result = await sampling_client.sample_async(prompt=types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params)
    seq = result.sequences[0]
    logprobs = await sampling_client.compute_logprobs(types.ModelInput.from_ints(PROMPT + seq.tokens))
    fwd_bwd_future = await training_client.forward_backward_async(datums(result), loss_fn="importance_sampling")
    optim_future = await training_client.optim_step_async(types.AdamParams(learning_rate=1e-2))
    fwd_bwd = await fwd_bwd_future
    await optim_future
    return dict(sampled=list(seq.logprobs), recomputed=logprobs[len(PROMPT):], metrics=fwd_bwd.metrics)
'''

IMPORTS = {"import tinker": "import temper.client as tinker", "from tinker import types": "from temper.client import types"}


def port(script: str) -> str:
    """Rewrite the import lines, and only them."""
    ported = "\n".join(IMPORTS.get(line, line) for line in script.splitlines())
    changed = [(a, b) for a, b in zip(script.splitlines(), ported.splitlines()) if a != b]
    assert changed and all(a in IMPORTS for a, _ in changed) and "tinker." not in "".join(b for _, b in changed)
    assert not re.search(r"^\s*(import|from)\s+tinker\b", ported, re.M)
    return ported


def run_script(script: str, *args):
    namespace: dict = {"__name__": "ported_script"}
    exec(compile(port(script), "<ported>", "exec"), namespace)
    return namespace["main"](*args)


@pytest.fixture
def tinker_env(stack, monkeypatch):
    """A Tinker user's environment, pointing at the scheduler (a gRPC address: temper.client's)."""
    for name in ("TEMPER_BASE_URL", "TEMPER_ADDRESS", "TEMPER_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TINKER_BASE_URL", stack.address)
    monkeypatch.setenv("TINKER_API_KEY", stack.key_for("porter"))


def test_sft_loop_ports_by_changing_imports(tinker_env, tiny_model_dir):
    out = run_script(SFT_SCRIPT, tiny_model_dir)
    assert out["losses"][-1] < out["losses"][0] and out["after"] < out["losses"][0]
    # resumed from the step-3 state (on a new run, and on the run itself): the loss it had then
    assert out["resumed_loss"] == pytest.approx(out["step3_loss"], rel=1e-4)
    assert out["reloaded_loss"] == pytest.approx(out["step3_loss"], rel=1e-4)
    assert out["state_path"] in out["checkpoints"] and out["sampler_path"] in out["checkpoints"]
    assert set(out["checkpoints"]) <= set(out["user_checkpoints"])
    assert out["run"].last_checkpoint.tinker_path == out["state_path"] and out["run"].lora_rank == 4
    assert len(out["sample"].sequences) == 2 and all(len(s.tokens) <= 4 for s in out["sample"].sequences)


def test_rl_loop_ports_by_changing_imports(tinker_env, tiny_model_dir):
    out = run_script(RL_SCRIPT, tiny_model_dir)
    assert len(out["metrics"]) == 2 and all(np.isfinite(m["loss:sum"]) for m in out["metrics"])
    on_policy = out["on_policy"]
    np.testing.assert_allclose(on_policy["recomputed"], on_policy["sampled"], atol=1e-3)
    assert np.isfinite(on_policy["metrics"]["loss:sum"])


def test_rest_client_and_tokenizer_from_the_server(tinker_env, stack, tiny_model_dir, tmp_path, monkeypatch):
    import temper.client as tinker
    from transformers import AutoTokenizer

    service_client = tinker.ServiceClient()
    try:
        tc = service_client.create_lora_training_client(tiny_model_dir, rank=4, seed=2).result()
        path = tc.save_state("keep").result().path
        rest = tinker.RestClient()  # on its own connection, as tinker.RestClient() is
        try:
            runs = rest.list_training_runs(limit=50).result()
            assert tc.model_id in [r.training_run_id for r in runs.training_runs] and runs.cursor.total_count >= 1
            info = rest.get_weights_info_by_tinker_path(path).result()
            assert info.base_model == tiny_model_dir and info.lora_rank == 4
            rest.delete_checkpoint_from_tinker_path(path).result()
            assert path not in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
            with pytest.raises(tinker.NotFoundError):
                rest.delete_checkpoint_from_tinker_path(path).result()
        finally:
            rest.close()

        # A client elsewhere: the tokenizer id names no folder here, so the files come from the server.
        monkeypatch.setenv("TEMPER_TOKENIZER_CACHE", str(tmp_path / "cache"))
        fetched = load_tokenizer(service_client.runtime, tiny_model_dir, "some-org/not-on-this-machine")
        assert (cache_folder(tiny_model_dir, "some-org/not-on-this-machine") / "tokenizer.json").is_file()
        local = AutoTokenizer.from_pretrained(tiny_model_dir)
        text = "the judge answers A or B"
        assert fetched.encode(text) == local.encode(text) and len(fetched) == len(local)
        with pytest.raises(tinker.NotFoundError, match="no trainer serves"):
            load_tokenizer(service_client.runtime, "no-such-model", "no-such-org/model")
    finally:
        service_client.close()
