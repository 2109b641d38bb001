"""The trainer engine against a direct torch computation, on the tiny model (no network).

The engine takes domain objects; tests of wire payloads go through ``convert`` as the servicer does."""

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from temper.common.codec import decode_array, encode_array, encode_tokens
from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound
from temper.common.validation import DecodedDatum
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.trainer import convert
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import AdamParams, ForwardBackwardItem, OptimStepItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, types_pb2

SPEC = AdapterSpec(rank=4, alpha=32.0, targets=lora_targets(attn=True, mlp=True, unembed=True))


def sft(tokens, weights) -> DecodedDatum:
    """A next-token datum: inputs tokens[:-1], targets tokens[1:]."""
    return DecodedDatum(tokens=np.asarray(tokens[:-1], np.int32),
                        inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.asarray(weights, np.float32)})


def fb(run_id, data, **kwargs) -> ForwardBackwardItem:
    return ForwardBackwardItem(run_id=run_id, data=list(data), **kwargs)


def datum(tokens, weights, dtype_t="int64", dtype_w="float32"):
    """The same datum as it arrives on the wire."""
    return types_pb2.Datum(
        model_input=types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens[:-1])))]),
        loss_fn_inputs={"target_tokens": encode_array(np.asarray(tokens[1:]), dtype_t), "weights": encode_array(np.asarray(weights), dtype_w)},
    )


def run_wire(engine, forward_backward, optim_step=()):
    """A cycle as the servicer runs it: decode and check, then the engine."""
    request = trainer_pb2.CycleRequest(forward_backward=forward_backward, optim_step=optim_step)
    return engine.run_cycle(*convert.cycle_from_pb(request, engine.loaded.vocab_size, engine.loaded.max_context_length))


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    settings = TrainerSettings(checkpoint_dir=tmp_path / "ckpt", logprob_chunk_tokens=5, max_tokens_per_microbatch=24)
    eng = TrainerEngine(load_model(tiny_model_dir), settings)
    eng.create_adapter("run-a", SPEC, seed=3)
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
    item = fb("run-a", [sft(t, w) for t, w in raw])
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
    item = fb("run-a", [sft(t, w) for t, w in raw])
    engine.run_cycle([item], [])
    adapter = engine.host.get("run-a")
    once = {n: p.grad.clone() for n, p in adapter.params.items()}
    forward = fb("run-a", item.data, forward_only=True)
    engine.run_cycle([forward], [])
    for n, p in adapter.params.items():
        assert torch.equal(p.grad, once[n])
    engine.run_cycle([item], [])
    for n, p in adapter.params.items():
        torch.testing.assert_close(p.grad, 2 * once[n])
    before = {n: p.detach().clone() for n, p in adapter.params.items()}
    _, (metrics,) = engine.run_cycle([], [OptimStepItem("run-a", AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8))])
    assert metrics["step:max"] == 1
    assert all(p.grad is None for p in adapter.params.values())
    assert any(not torch.equal(p, before[n]) for n, p in adapter.params.items())


def test_optim_step_matches_torch_adamw(engine):
    adapter = engine.host.get("run-a")
    raw = random_data(n=2, seed=2)
    item = fb("run-a", [sft(t, w) for t, w in raw])
    engine.run_cycle([item], [])
    params = {n: p.detach().clone().requires_grad_(True) for n, p in adapter.params.items()}
    for n, p in params.items():
        p.grad = adapter.params[n].grad.clone()
    reference = torch.optim.AdamW(list(params.values()), lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
    reference.step()
    adam = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)
    engine.run_cycle([], [OptimStepItem("run-a", adam)])
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
    ],
)
def test_a_run_with_a_bad_item_is_refused_whole_and_changes_nothing(engine, make_item, error, match):
    good = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum([5, 6, 7, 8], [1, 1, 1])], loss_fn="cross_entropy")
    run_wire(engine, [good])
    adapter = engine.host.get("run-a")
    grads = {n: p.grad.clone() for n, p in adapter.params.items()}
    weights = {n: p.detach().clone() for n, p in adapter.params.items()}
    step = trainer_pb2.OptimStepItem(training_run_id="run-a", adam_params=types_pb2.AdamParams(learning_rate=1.0, eps=1e-8))
    results, steps = run_wire(engine, [good, make_item()], [step])  # the run's good item and step must not run either
    for outcome in [*results, *steps]:
        assert isinstance(outcome, error) and re.search(match, outcome.message), outcome
    for n, p in adapter.params.items():
        assert torch.equal(p.grad, grads[n]) and torch.equal(p.detach(), weights[n])
    assert adapter.steps == 0


def test_save_and_load_round_trip_with_optimizer(engine, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    raw = random_data(n=2, seed=4)
    item = fb("run-a", [sft(t, w) for t, w in raw])
    step = OptimStepItem("run-a", AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8))
    engine.run_cycle([item], [step])
    engine.save("run-a", "run-a/weights/s1", include_optimizer=True)
    # peft loads the folder unchanged and gives the same outputs
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(engine.store.existing("run-a/weights/s1")))
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad(), engine.lora.route([("run-a", None)]):
        torch.testing.assert_close(peft_model(input_ids=ids).logits, engine.loaded.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    # a second run loads the state and then steps exactly like the first
    engine.create_adapter("run-b", SPEC, seed=3)
    engine.load("run-b", "run-a/weights/s1", with_optimizer=True)
    for_b = fb("run-b", item.data)
    step_b = OptimStepItem("run-b", step.adam)
    engine.run_cycle([item], [step])
    engine.run_cycle([for_b], [step_b])
    a, b = engine.host.get("run-a"), engine.host.get("run-b")
    for n in a.params:
        torch.testing.assert_close(a.params[n].detach(), b.params[n].detach(), atol=1e-6, rtol=1e-5)
    assert a.steps == b.steps == 2


def adapter_state(engine, run_id):
    adapter = engine.host.get(run_id)
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
    engine.create_adapter("run-b", AdapterSpec(rank=2, alpha=32.0, targets=lora_targets(attn=True)), seed=4)
    adam = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    items = [fb("run-a", [sft(t, w) for t, w in random_data(2, seed=1)], seq_id=1)]
    step = [OptimStepItem("run-a", adam, seq_id=2)]
    results, metrics = engine.run_cycle(items, step)
    after = adapter_state(engine, "run-a")

    # the same cycle again, as a restarted scheduler would send it, plus new work of another run
    other = fb("run-b", [sft(t, w) for t, w in random_data(1, seed=2)], seq_id=1)
    again, metrics_again = engine.run_cycle(items + [other], step)
    assert again[0] is results[0] and metrics_again == metrics  # the first answers, not a recomputation
    assert_same_state(adapter_state(engine, "run-a"), after)  # no second gradient, no second step
    assert engine.host.get("run-b").applied_seq == 1 and again[1].metrics["loss:sum"] != 0.0

    # a newer seq runs as usual; one applied so long ago that its answer is gone is refused
    newer = fb("run-a", items[0].data, seq_id=3)
    (fresh,), _ = engine.run_cycle([newer], [])
    assert engine.host.get("run-a").applied_seq == 3 and engine.host.get("run-a").pending_tokens > 0
    engine.host.get("run-a").answers.pop(1)
    before = adapter_state(engine, "run-a")
    (gone,), _ = engine.run_cycle(items, [])
    assert isinstance(gone, FailedPrecondition) and "no longer held" in gone.message
    assert_same_state(adapter_state(engine, "run-a"), before)


def test_cycle_protobuf_round_trip(engine):
    raw = random_data(n=2, seed=6)
    request = trainer_pb2.CycleRequest(
        forward_backward=[trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum(t, w) for t, w in raw],
                                                          loss_fn="cross_entropy", seq_id=4)],
        optim_step=[trainer_pb2.OptimStepItem(training_run_id="run-a", seq_id=5, adam_params=types_pb2.AdamParams(
            learning_rate=1e-3, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.1, grad_clip_norm=2.0))])
    (item,), (step,) = convert.cycle_from_pb(request, engine.loaded.vocab_size)
    assert (item.run_id, item.seq_id, item.loss_fn, item.forward_only) == ("run-a", 4, "cross_entropy", False)
    for got, (tokens, weights) in zip(item.data, raw):
        np.testing.assert_array_equal(got.tokens, tokens[:-1])
        np.testing.assert_array_equal(got.inputs["target_tokens"], tokens[1:])
        np.testing.assert_array_equal(got.inputs["weights"], weights)
    assert step == OptimStepItem("run-a", AdamParams(1e-3, 0.8, 0.9, 1e-7, 0.1, 2.0), seq_id=5)
    results, steps = engine.run_cycle([item], [step])
    response = convert.cycle_to_pb(results, steps)
    (out,), (step_out,) = response.forward_backward, response.optim_step
    assert dict(out.metrics) == results[0].metrics and dict(step_out.metrics) == steps[0]
    for wire, lp, loss in zip(out.loss_fn_outputs, results[0].logprobs, results[0].elementwise_loss):
        np.testing.assert_array_equal(decode_array(wire.fields["logprobs"]), lp)
        np.testing.assert_array_equal(decode_array(wire.fields["elementwise_loss"]), loss)
    # unset fields are Tinker's defaults (common/defaults.py); one set out of range is still refused
    assert convert.adam_from_pb(types_pb2.AdamParams(learning_rate=1e-3)) == AdamParams(
        learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
    with pytest.raises(InvalidArgument, match="eps"):
        convert.adam_from_pb(types_pb2.AdamParams(learning_rate=1e-3, eps=0.0))


def test_lora_config_converts_to_an_adapter_spec():
    spec, seed = convert.adapter_from_pb(types_pb2.LoraConfig(rank=8, train_mlp=True, train_unembed=True, seed=5), 32.0)
    assert spec == AdapterSpec(rank=8, alpha=32.0, targets=("down_proj", "gate_proj", "lm_head", "up_proj")) and seed == 5
    assert convert.adapter_from_pb(types_pb2.LoraConfig(rank=2, alpha=4, train_attn=True, dropout=0.1), 32.0) == (
        AdapterSpec(rank=2, alpha=4.0, targets=("k_proj", "o_proj", "q_proj", "v_proj"), dropout=pytest.approx(0.1)), None)
    for bad, match in [(dict(rank=0, train_attn=True), "rank"), (dict(rank=2), "trains nothing"),
                       (dict(rank=2, train_attn=True, dropout=1.0), "dropout")]:
        with pytest.raises(InvalidArgument, match=match):
            convert.adapter_from_pb(types_pb2.LoraConfig(**bad), 32.0)


def test_metrics_move_by_what_the_cycle_did(engine):
    from prometheus_client import REGISTRY

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    names = ["temper_trainer_tokens_trained_total", "temper_trainer_tokens_forward_total", "temper_trainer_cycles_total",
             "temper_trainer_optim_steps_total", "temper_trainer_cycle_seconds_count"]
    before = {n: value(n) for n in names}
    passes_before = value("temper_trainer_pass_seconds_count", kind="forward_backward")
    raw = random_data(n=3, seed=7)
    train = fb("run-a", [sft(t, w) for t, w in raw])
    forward = fb("run-a", [sft(t, w) for t, w in raw[:2]], forward_only=True)
    engine.create_adapter("run-b", SPEC, seed=1)
    engine.run_cycle([train, forward], [OptimStepItem("run-a", AdamParams(learning_rate=1e-3))])
    moved = {n: value(n) - before[n] for n in names}
    assert moved["temper_trainer_tokens_trained_total"] == sum(len(t) - 1 for t, _ in raw)
    assert moved["temper_trainer_tokens_forward_total"] == sum(len(t) - 1 for t, _ in raw[:2])
    assert moved["temper_trainer_cycles_total"] == moved["temper_trainer_cycle_seconds_count"] == 1
    assert moved["temper_trainer_optim_steps_total"] == 1
    assert value("temper_trainer_pass_seconds_count", kind="forward_backward") > passes_before
    assert value("temper_trainer_resident_adapters") == 2 and value("temper_trainer_offloaded_adapters") == 0
    assert value("temper_trainer_rss_bytes") > 0
    engine.drop_adapter("run-b")
    assert value("temper_trainer_resident_adapters") == 1


def test_the_engine_imports_no_protobuf():
    # the engine is transport-free: convert.py is the only trainer module that knows temper.v1
    code = ("import sys, temper.services.trainer.engine, temper.services.trainer.numerics, temper.services.sampler.torch_backend\n"
            "print(sorted(m for m in sys.modules if m.startswith(('temper.v1', 'google.protobuf'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_servicer_decodes_runs_encodes_and_counts_refused_items(engine):
    import asyncio

    import grpc
    from prometheus_client import REGISTRY

    from temper.services.trainer.servicer import TrainerServicer

    servicer = TrainerServicer(engine)
    raw = random_data(n=2, seed=8)
    item = trainer_pb2.ForwardBackwardItem(training_run_id="run-a", data=[datum(t, w) for t, w in raw], loss_fn="cross_entropy")
    want = direct(engine, raw)[0]
    response = asyncio.run(servicer.RunCycle(trainer_pb2.CycleRequest(forward_backward=[item]), None))
    assert response.forward_backward[0].metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-4)
    labels = {"code": "NOT_FOUND"}  # failed calls are the error interceptor's (tests/unit/test_error_counting.py)
    before = REGISTRY.get_sample_value("temper_trainer_refused_items_total", labels) or 0.0
    missing = trainer_pb2.ForwardBackwardItem(training_run_id="missing", data=item.data, loss_fn="cross_entropy")
    response = asyncio.run(servicer.RunCycle(trainer_pb2.CycleRequest(forward_backward=[missing, item]), None))
    refused, ran = response.forward_backward_status
    assert refused.code == grpc.StatusCode.NOT_FOUND.value[0] and "not loaded" in refused.message and ran.code == 0
    assert response.forward_backward[1].metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert REGISTRY.get_sample_value("temper_trainer_refused_items_total", labels) == before + 1
    asyncio.run(servicer.CreateAdapter(trainer_pb2.CreateAdapterRequest(
        training_run_id="run-c", lora_config=types_pb2.LoraConfig(rank=2, train_mlp=True)), None))
    assert engine.host.get("run-c").spec == AdapterSpec(rank=2, alpha=32.0, targets=lora_targets(mlp=True))


def test_the_servicer_deletes_a_checkpoint_once_and_reports_its_bytes(engine):
    import asyncio

    from temper.services.trainer.servicer import TrainerServicer

    servicer = TrainerServicer(engine)
    saved = asyncio.run(servicer.SaveAdapter(trainer_pb2.SaveAdapterRequest(
        training_run_id="run-a", checkpoint_key="run-a/weights/d1", include_optimizer=True), None))
    delete = trainer_pb2.DeleteCheckpointFilesRequest(checkpoint_key="run-a/weights/d1")
    assert saved.size_bytes > 0 and asyncio.run(servicer.DeleteCheckpoint(delete, None)).freed_bytes == saved.size_bytes
    assert asyncio.run(servicer.DeleteCheckpoint(delete, None)).freed_bytes == 0
    with pytest.raises(NotFound):
        engine.load("run-a", "run-a/weights/d1", with_optimizer=False)
    with pytest.raises(InvalidArgument, match="bad checkpoint key"):
        asyncio.run(servicer.DeleteCheckpoint(trainer_pb2.DeleteCheckpointFilesRequest(checkpoint_key="../../etc"), None))


def test_a_pass_whose_loss_or_gradient_is_not_finite_changes_nothing(engine):
    # Past the wire checks (which bound loss inputs), the engine still refuses a non-finite result:
    # an optim_step on it would turn the adapter into NaN for good.
    ce = {"loss_fn": "cross_entropy", "loss_config": {}}
    engine.run_cycle([fb("run-a", [sft([1, 2, 3, 4], [1, 1, 1])], **ce, seq_id=1)], [])
    before = adapter_state(engine, "run-a")
    overflowing = fb("run-a", [sft([5, 6, 7, 8], [3e38, 3e38, 3e38])], **ce, seq_id=2)
    (refused,), (step,) = engine.run_cycle([overflowing], [OptimStepItem("run-a", AdamParams(learning_rate=1e-2, eps=1e-8), seq_id=3)])
    assert isinstance(refused, InvalidArgument) and "not finite" in refused.message and step is refused
    assert_same_state(before, adapter_state(engine, "run-a"))  # weights, pending grads, Adam state, steps
    _, (metrics,) = engine.run_cycle([], [OptimStepItem("run-a", AdamParams(learning_rate=1e-2, eps=1e-8), seq_id=2)])
    assert np.isfinite(metrics["grad_norm:mean"]) and metrics["grad_norm:mean"] > 0
    assert all(bool(torch.isfinite(p).all()) for p in engine.host.get("run-a").params.values())
