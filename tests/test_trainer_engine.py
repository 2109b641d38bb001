"""The trainer engine against a direct torch computation, on the tiny model (no network)."""

import numpy as np
import pytest
import torch

from temper.common.codec import encode_array, encode_tokens
from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound
from temper.services.models.loading import load_model
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, types_pb2

LORA = types_pb2.LoraConfig(rank=4, train_attn=True, train_mlp=True, train_unembed=True, seed=3)


def datum(tokens, weights, dtype_t="int64", dtype_w="float32"):
    return types_pb2.Datum(
        model_input=types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens[:-1])))]),
        loss_fn_inputs={"target_tokens": encode_array(np.asarray(tokens[1:]), dtype_t), "weights": encode_array(np.asarray(weights), dtype_w)},
    )


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    settings = TrainerSettings(checkpoint_dir=tmp_path / "ckpt", logprob_chunk_tokens=5, max_tokens_per_microbatch=24)
    eng = TrainerEngine(load_model(tiny_model_dir), settings)
    eng.host.create("run-a", LORA)
    return eng


def random_data(n=3, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(4, 14, n):
        tokens = rng.integers(0, vocab, length).tolist()
        out.append((tokens, rng.standard_normal(length - 1).astype(np.float32)))  # signed weights are legal
    return out


def direct(engine, raw):
    """Loss, per-datum logprobs and LoRA grads computed the plain way: one datum at a time, full logits."""
    adapter = engine.host.get("run-a")
    for p in adapter.params.values():
        p.grad = None
    total, logprobs = 0.0, []
    for tokens, weights in raw:
        ids = torch.tensor(tokens[:-1])[None]
        with engine.lora.route([("run-a", None)]):
            logits = engine.loaded.model(input_ids=ids).logits[0].float()
        lp = logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        loss = -(lp * torch.from_numpy(weights)).sum()
        loss.backward()
        total += float(loss.detach())
        logprobs.append(lp.detach().numpy())
    grads = {n: p.grad.clone() for n, p in adapter.params.items()}
    for p in adapter.params.values():
        p.grad = None
    return total, logprobs, grads


def test_cross_entropy_matches_direct_torch(engine):
    raw = random_data(n=4)
    item = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum(t, w) for t, w in raw], loss_fn="cross_entropy")
    want_loss, want_lp, want_grads = direct(engine, raw)
    (result,), _ = engine.run_cycle([item], [])
    assert result.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5, abs=1e-4)
    for got, want in zip(result.logprobs, want_lp):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for (tokens, weights), loss in zip(raw, result.elementwise_loss):
        assert loss.shape == (len(tokens) - 1,)
    grads = engine.host.get("run-a").params
    for name, param in grads.items():
        torch.testing.assert_close(param.grad, want_grads[name], atol=1e-5, rtol=1e-4)


def test_gradients_accumulate_until_optim_step_and_forward_only_touches_nothing(engine):
    raw = random_data(n=2, seed=1)
    item = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum(t, w) for t, w in raw], loss_fn="cross_entropy")
    engine.run_cycle([item], [])
    adapter = engine.host.get("run-a")
    once = {n: p.grad.clone() for n, p in adapter.params.items()}
    forward = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=item.data, loss_fn="cross_entropy", forward_only=True)
    engine.run_cycle([forward], [])
    for n, p in adapter.params.items():
        assert torch.equal(p.grad, once[n])
    engine.run_cycle([item], [])
    for n, p in adapter.params.items():
        torch.testing.assert_close(p.grad, 2 * once[n])
    before = {n: p.detach().clone() for n, p in adapter.params.items()}
    _, (metrics,) = engine.run_cycle([], [trainer_pb2.OptimStepItem(training_run_id="run-a", adam_params=types_pb2.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8))])
    assert metrics["step:max"] == 1
    assert all(p.grad is None for p in adapter.params.values())
    assert any(not torch.equal(p, before[n]) for n, p in adapter.params.items())


def test_optim_step_matches_torch_adamw(engine):
    adapter = engine.host.get("run-a")
    raw = random_data(n=2, seed=2)
    item = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum(t, w) for t, w in raw], loss_fn="cross_entropy")
    engine.run_cycle([item], [])
    params = {n: p.detach().clone().requires_grad_(True) for n, p in adapter.params.items()}
    for n, p in params.items():
        p.grad = adapter.params[n].grad.clone()
    reference = torch.optim.AdamW(list(params.values()), lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
    reference.step()
    adam = types_pb2.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)
    engine.run_cycle([], [trainer_pb2.OptimStepItem(training_run_id="run-a", adam_params=adam)])
    for n, p in adapter.params.items():
        torch.testing.assert_close(p.detach(), params[n].detach(), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize(
    "make_item, error, match",
    [
        (lambda: trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([1, 2, 3], [1, 1], dtype_t="int32")], loss_fn="cross_entropy"), InvalidArgument, "must be int64"),
        (lambda: trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([1, 2, 3], [1, 1, 1])], loss_fn="cross_entropy"), InvalidArgument, "shape"),
        (lambda: trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([1, 2, 9999], [1, 1])], loss_fn="cross_entropy"), InvalidArgument, "outside the vocabulary"),
        (lambda: trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([1, 2, 3], [1, 1])], loss_fn="nope"), InvalidArgument, "unknown loss_fn"),
        (lambda: trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([1, 2, 3], [1, float("nan")])], loss_fn="cross_entropy"), InvalidArgument, "NaN"),
        (lambda: trainer_pb2.ForwardBackwardItem(training_run_id="missing", data=[datum([1, 2, 3], [1, 1])], loss_fn="cross_entropy"), NotFound, "not loaded"),
    ],
)
def test_rejected_cycle_changes_nothing(engine, make_item, error, match):
    good = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([5, 6, 7, 8], [1, 1, 1])], loss_fn="cross_entropy")
    engine.run_cycle([good], [])
    adapter = engine.host.get("run-a")
    grads = {n: p.grad.clone() for n, p in adapter.params.items()}
    weights = {n: p.detach().clone() for n, p in adapter.params.items()}
    step = trainer_pb2.OptimStepItem(training_run_id="run-a", adam_params=types_pb2.AdamParams(learning_rate=1.0, eps=1e-8))
    with pytest.raises(error, match=match):
        engine.run_cycle([good, make_item()], [step])  # the good item and the step must not run either
    for n, p in adapter.params.items():
        assert torch.equal(p.grad, grads[n]) and torch.equal(p.detach(), weights[n])
    assert adapter.steps == 0


def test_save_and_load_round_trip_with_optimizer(engine, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    raw = random_data(n=2, seed=4)
    item = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum(t, w) for t, w in raw], loss_fn="cross_entropy")
    step = trainer_pb2.OptimStepItem(training_run_id="run-a", adam_params=types_pb2.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8))
    engine.run_cycle([item], [step])
    engine.save("run-a", "run-a/weights/s1", include_optimizer=True)
    # peft loads the folder unchanged and gives the same outputs
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(engine.store.existing("run-a/weights/s1")))
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad(), engine.lora.route([("run-a", None)]):
        torch.testing.assert_close(peft_model(input_ids=ids).logits, engine.loaded.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    # a second run loads the state and then steps exactly like the first
    engine.host.create("run-b", LORA)
    engine.load("run-b", "run-a/weights/s1", with_optimizer=True)
    for_b = trainer_pb2.ForwardBackwardItem(training_run_id="run-b", data=item.data, loss_fn="cross_entropy")
    step_b = trainer_pb2.OptimStepItem(training_run_id="run-b", adam_params=step.adam_params)
    engine.run_cycle([item], [step])
    engine.run_cycle([for_b], [step_b])
    a, b = engine.host.get("run-a"), engine.host.get("run-b")
    for n in a.params:
        torch.testing.assert_close(a.params[n].detach(), b.params[n].detach(), atol=1e-6, rtol=1e-5)
    assert a.steps == b.steps == 2


def adapter_state(engine, adapter_id):
    adapter = engine.host.get(adapter_id)
    params = {n: p.detach().clone() for n, p in adapter.params.items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in adapter.params.items()}
    adam = {n: {k: v.clone() for k, v in adapter.optimizer.state[p].items()} for n, p in adapter.params.items()
            if p in adapter.optimizer.state}
    return params, grads, adam, adapter.steps


def assert_same_state(a, b):
    for part_a, part_b in zip(a[:3], b[:3]):
        assert part_a.keys() == part_b.keys()
        for name in part_a:
            x, y = part_a[name], part_b[name]
            if isinstance(x, dict):
                for k in x:
                    assert torch.equal(x[k], y[k]), (name, k)
            else:
                assert (x is None and y is None) or torch.equal(x, y), name
    assert a[3] == b[3]


def test_a_re_sent_cycle_is_answered_from_memory_and_applied_once(engine):
    engine.host.create("run-b", types_pb2.LoraConfig(rank=2, train_attn=True, seed=4))
    adam = types_pb2.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    fb = [trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum(t, w) for t, w in random_data(2, seed=1)],
                                          loss_fn="cross_entropy", seq_id=1)]
    step = [trainer_pb2.OptimStepItem(training_run_id="run-a", adam_params=adam, seq_id=2)]
    results, metrics = engine.run_cycle(fb, step)
    after = adapter_state(engine, "run-a")

    # the same cycle again, as a restarted scheduler would send it, plus new work of another run
    other = trainer_pb2.ForwardBackwardItem(training_run_id="run-b", data=[datum(t, w) for t, w in random_data(1, seed=2)],
                                            loss_fn="cross_entropy", seq_id=1)
    again, metrics_again = engine.run_cycle(fb + [other], step)
    assert again[0] is results[0] and metrics_again == metrics  # the first answers, not a recomputation
    assert_same_state(adapter_state(engine, "run-a"), after)  # no second gradient, no second step
    assert engine.host.get("run-b").applied_seq == 1 and again[1].metrics["loss:sum"] != 0.0

    # a newer seq runs as usual; one applied so long ago that its answer is gone is refused
    newer = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=fb[0].data, loss_fn="cross_entropy", seq_id=3)
    (fresh,), _ = engine.run_cycle([newer], [])
    assert engine.host.get("run-a").applied_seq == 3 and engine.host.get("run-a").pending_tokens > 0
    engine.host.get("run-a").answers.pop(1)
    before = adapter_state(engine, "run-a")
    with pytest.raises(FailedPrecondition, match="no longer held"):
        engine.run_cycle(fb, [])
    assert_same_state(adapter_state(engine, "run-a"), before)
