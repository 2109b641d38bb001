"""Co-batching on the trainer: many adapters of different shapes in one pass give exactly what
each adapter gives alone (fp32), and steps on one adapter never touch another."""

import numpy as np
import pytest
import torch

from test_trainer_engine import fb, sft
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.trainer.adapters import OffloadedState, lora_targets
from temper.services.trainer.engine import AdamParams, OptimStepItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings


def spec(rank, alpha=32.0, dropout=0.0, **targets):
    return AdapterSpec(rank=rank, alpha=alpha, targets=lora_targets(**targets), dropout=dropout)


CONFIGS = {  # run id -> (adapter spec, seed)
    "r2-attn": (spec(2, attn=True), 1),
    "r4-mlp": (spec(4, mlp=True), 2),
    "r8-all": (spec(8, alpha=16, attn=True, mlp=True, unembed=True), 3),
    "r16-unembed": (spec(16, unembed=True), 4),
    "r3-attn-mlp": (spec(3, alpha=5, attn=True, mlp=True), 5),
    # same shapes as earlier ones: these share batched matmuls inside the LoRA layers
    "r4-mlp-twin": (spec(4, mlp=True), 6),
    "r8-all-twin": (spec(8, alpha=16, attn=True, mlp=True, unembed=True), 7),
}
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def make_engine(model_dir, tmp_path, **settings):
    engine = TrainerEngine(load_model(model_dir), TrainerSettings(checkpoint_dir=tmp_path / "ckpt", **settings))
    for key, (adapter_spec, seed) in CONFIGS.items():
        engine.create_adapter(key, adapter_spec, seed)
    return engine


def items_for(seed):
    rng = np.random.default_rng(seed)
    items = []
    for key in CONFIGS:
        data = []
        for _ in range(int(rng.integers(1, 4))):
            tokens = rng.integers(0, 512, int(rng.integers(5, 20))).tolist()
            data.append(sft(tokens, rng.standard_normal(len(tokens) - 1).astype(np.float32)))
        items.append(fb(key, data))
    return items


def grads(engine):
    return {key: {n: p.grad.clone() for n, p in engine.host.get(key).params.items()} for key in CONFIGS}


def test_mixed_batch_matches_each_adapter_alone(tiny_model_dir, tmp_path):
    items = items_for(0)
    mixed = make_engine(tiny_model_dir, tmp_path / "mixed")
    alone = make_engine(tiny_model_dir, tmp_path / "alone")
    mixed_results, _ = mixed.run_cycle(items, [])          # one cycle, all adapters in shared passes
    alone_results = [alone.run_cycle([item], [])[0][0] for item in items]
    for got, want in zip(mixed_results, alone_results):
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], abs=1e-5)
        for a, b in zip(got.logprobs, want.logprobs):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    g_mixed, g_alone = grads(mixed), grads(alone)
    for key in CONFIGS:
        for name in g_mixed[key]:
            assert (g_mixed[key][name] - g_alone[key][name]).abs().max().item() <= 1e-5, (key, name)


def test_rows_without_an_adapter_see_the_base_model(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path)
    for key in CONFIGS:  # make every adapter non-trivial
        with torch.no_grad():
            for p in engine.host.get(key).params.values():
                p.add_(0.05)
    ids = torch.tensor([[5, 9, 14, 200], [7, 3, 100, 42]])
    with torch.no_grad():
        with engine.lora.route([("r8-all", torch.tensor([0]))]):
            mixed = engine.loaded.model(input_ids=ids).logits
        with engine.lora.route([]):
            base = engine.loaded.model(input_ids=ids).logits
        with engine.lora.route([("r8-all", None)]):
            adapted = engine.loaded.model(input_ids=ids).logits
    torch.testing.assert_close(mixed[1], base[1], atol=0, rtol=0)
    torch.testing.assert_close(mixed[0], adapted[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(adapted[0], base[0])


def test_optim_step_on_one_adapter_leaves_the_others_bit_identical(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path)
    engine.run_cycle(items_for(1), [])
    before = {key: {n: (p.detach().clone(), p.grad.clone()) for n, p in engine.host.get(key).params.items()} for key in CONFIGS}
    states = {key: {n: dict(engine.host.get(key).optimizer.state.get(p, {})) for n, p in engine.host.get(key).params.items()} for key in CONFIGS}
    engine.run_cycle([], [OptimStepItem("r8-all", ADAM)])
    for key in CONFIGS:
        if key == "r8-all":
            continue
        for name, param in engine.host.get(key).params.items():
            weight, grad = before[key][name]
            assert torch.equal(param.detach(), weight) and torch.equal(param.grad, grad)
            assert engine.host.get(key).optimizer.state.get(param, {}) == states[key][name]
    assert engine.host.get("r8-all").steps == 1


def test_many_optim_steps_in_one_call_each_with_its_own_hyperparameters(tiny_model_dir, tmp_path):
    together = make_engine(tiny_model_dir, tmp_path / "t")
    separate = make_engine(tiny_model_dir, tmp_path / "s")
    items = items_for(2)
    params = {key: AdamParams(learning_rate=1e-3 * (i + 1), beta1=0.9, beta2=0.99 - 0.01 * i, eps=1e-8, weight_decay=0.01 * i)
              for i, key in enumerate(CONFIGS)}
    together.run_cycle(items, [OptimStepItem(k, p) for k, p in params.items()])
    for item in items:
        separate.run_cycle([item], [OptimStepItem(item.run_id, params[item.run_id])])
    for key in CONFIGS:
        for name, p in together.host.get(key).params.items():
            torch.testing.assert_close(p.detach(), separate.host.get(key).params[name].detach(), atol=1e-6, rtol=1e-5)


def test_micro_batching_and_logprob_chunking_do_not_change_results(tiny_model_dir, tmp_path):
    items = items_for(3)
    small = make_engine(tiny_model_dir, tmp_path / "small", max_tokens_per_microbatch=20, logprob_chunk_tokens=3)
    large = make_engine(tiny_model_dir, tmp_path / "large", max_tokens_per_microbatch=100000, logprob_chunk_tokens=100000)
    r_small, _ = small.run_cycle(items, [])
    r_large, _ = large.run_cycle(items, [])
    for a, b in zip(r_small, r_large):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], abs=1e-5)
    g_small, g_large = grads(small), grads(large)
    for key in CONFIGS:
        for name in g_small[key]:
            torch.testing.assert_close(g_small[key][name], g_large[key][name], atol=1e-5, rtol=1e-4)


def test_activation_checkpointing_does_not_change_results(tiny_model_dir, tmp_path):
    items = items_for(5)
    engines = {on: make_engine(tiny_model_dir, tmp_path / str(on), activation_checkpointing=on, activation_checkpointing_min_tokens=0)
               for on in (True, False)}
    calls = count_layer_calls(engines[True])
    results = {on: engine.run_cycle(items, [])[0] for on, engine in engines.items()}
    for a, b in zip(results[True], results[False]):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], abs=1e-6)
        for x, y in zip(a.logprobs, b.logprobs):
            np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)
    assert calls["n"] > 0 and calls["n"] % 2 == 0  # every layer ran twice per pass: forward, then recompute
    g_on, g_off = grads(engines[True]), grads(engines[False])
    for key in CONFIGS:
        for name in g_on[key]:
            torch.testing.assert_close(g_on[key][name], g_off[key][name], atol=1e-6, rtol=1e-5)


def count_layer_calls(engine) -> dict:
    """Count the first decoder layer's attention calls (recomputations included)."""
    attention = engine.loaded.model.get_decoder().layers[0].self_attn
    calls = {"n": 0}
    inner = attention.forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return inner(*args, **kwargs)

    attention.forward = counted
    return calls


def test_only_passes_past_the_token_threshold_are_checkpointed(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path, activation_checkpointing_min_tokens=10_000)
    calls = count_layer_calls(engine)
    items = items_for(7)
    engine.run_cycle(items, [])
    stored = calls["n"]
    assert stored == 1  # one micro-batch, below the threshold: one forward, no recompute
    engine.settings.activation_checkpointing_min_tokens = 1
    engine.run_cycle(items, [])
    assert calls["n"] - stored == 2  # forward + recompute in the backward pass


def test_checkpointed_dropout_recomputes_the_same_masks(tiny_model_dir, tmp_path):
    # the backward pass recomputes each layer; its dropout masks must be the forward's, or the
    # gradient belongs to no forward at all. Same torch seed, with and without checkpointing.
    dropout = spec(4, dropout=0.3, attn=True, mlp=True)
    item = fb("dropout", items_for(6)[0].data)
    out = {}
    for on in (True, False):
        engine = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(
            checkpoint_dir=tmp_path / f"d{on}", activation_checkpointing=on, activation_checkpointing_min_tokens=0))
        engine.create_adapter("dropout", dropout, seed=9)
        with torch.no_grad():
            for p in engine.host.get("dropout").params.values():
                p.add_(0.05)
        torch.manual_seed(123)
        result = engine.run_cycle([item], [])[0][0]
        out[on] = (result.metrics["loss:sum"], {n: p.grad.clone() for n, p in engine.host.get("dropout").params.items()})
    assert out[True][0] == pytest.approx(out[False][0], abs=1e-6)
    for name, grad in out[True][1].items():
        torch.testing.assert_close(grad, out[False][1][name], atol=1e-6, rtol=1e-5)


def test_lora_dropout_is_applied_when_asked(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path)
    engine.create_adapter("dropout", spec(4, dropout=0.5, attn=True), seed=7)
    with torch.no_grad():
        for p in engine.host.get("dropout").params.values():
            p.add_(0.1)
    item = fb("dropout", items_for(4)[0].data, forward_only=True)
    first, second = (engine.run_cycle([item], [])[0][0] for _ in range(2))
    assert not np.allclose(first.logprobs[0], second.logprobs[0])  # dropout masks differ between passes


@pytest.mark.parametrize("offload_to", ["disk", "host"])
def test_evicted_adapters_come_back_with_weights_grads_and_adam_state(tiny_model_dir, tmp_path, offload_to):
    limited = make_engine(tiny_model_dir, tmp_path / "limited", max_resident_adapters=2, offload_dir=tmp_path / "offload",
                          offload_to=offload_to)
    unlimited = make_engine(tiny_model_dir, tmp_path / "unlimited")
    assert len(limited.host.resident()) == 2
    items = items_for(5)
    for engine in (limited, unlimited):
        for round_ in range(3):  # every cycle touches two adapters; the others wait offloaded
            for a, b in zip(items[::2], items[1::2]):
                engine.run_cycle([a, b], [OptimStepItem(a.run_id, ADAM)])
            engine.run_cycle([items[-1]], [])  # leaves gradients pending on an adapter that gets evicted
    assert len(limited.host.resident()) == 2
    evicted = [a.offloaded for a in limited.host.adapters.values() if a.offloaded is not None]
    assert len(evicted) == len(CONFIGS) - 2
    if offload_to == "disk":
        assert sorted(p.name for p in (tmp_path / "offload").iterdir()) == sorted(path.name for path in evicted)
    else:  # kept in host memory: no files
        assert all(isinstance(state, OffloadedState) for state in evicted) and not (tmp_path / "offload").exists()
    for key in CONFIGS:
        a, b = limited.host.get(key), unlimited.host.get(key)   # brought back on access
        assert a.steps == b.steps
        for name in b.params:
            assert torch.equal(a.params[name].detach(), b.params[name].detach()), (key, name)
            assert (a.params[name].grad is None) == (b.params[name].grad is None)
            if b.params[name].grad is not None:
                assert torch.equal(a.params[name].grad, b.params[name].grad)
            sa, sb = a.optimizer.state.get(a.params[name], {}), b.optimizer.state.get(b.params[name], {})
            assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sb)
        assert len(limited.host.resident()) <= 2


def test_memory_decides_checkpointing_and_micro_batching(tiny_model_dir, tmp_path):
    """Unset token rule: a pass that fits the activation budget stores its activations (one forward
    per layer), a bigger one is split into stored micro-batches, and only what cannot fit stored
    in micro-batches of a useful size is checkpointed; results are the same every way."""
    items = items_for(7)
    rows = sum(len(i.data) for i in items)
    engine = make_engine(tiny_model_dir, tmp_path / "m", activation_memory_mib=1 << 20)
    calls = count_layer_calls(engine)
    base, _ = engine.run_cycle(items, [])
    assert calls["n"] == 1  # one stored pass
    options = engine.pass_options
    width = max(len(d.tokens) for i in items for d in i.data) - 1
    one_row = options.pass_bytes(width, width, False)
    engine.settings.activation_memory_mib = 0
    engine.auto_activation_budget = int(one_row * 2.5)  # ~2 rows stored per micro-batch
    engine.settings.activation_checkpointing = False
    before = calls["n"]
    split, _ = engine.run_cycle(items, [])
    assert rows // 2 <= calls["n"] - before <= rows  # several stored micro-batches, no recompute
    engine.settings.activation_checkpointing = True
    engine.auto_activation_budget = int(options.pass_bytes(width, width, True) * 1.01)  # one row fits only checkpointed
    before = calls["n"]
    engine.run_cycle(items, [])
    from temper.services.trainer.numerics import Row, plan_passes

    planned = list(plan_passes([Row(i, j, d) for i, item in enumerate(items) for j, d in enumerate(item.data)], engine.pass_options))
    assert any(checkpointed for _, checkpointed in planned)
    # a recompute per checkpointed pass, but for rows whose adapter has no decoder layer (r16-unembed)
    assert len(planned) < calls["n"] - before <= sum(2 if checkpointed else 1 for _, checkpointed in planned)
    for a, b in zip(base, split):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], abs=1e-5)


def test_plan_passes_prefers_stored_micro_batches_over_checkpointing():
    from types import SimpleNamespace

    from temper.services.trainer.memory import ActivationModel
    from temper.services.trainer.numerics import PassOptions, Row, plan_passes

    model = ActivationModel(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=100, dtype_bytes=4)
    rows = [Row(0, i, SimpleNamespace(tokens=np.zeros(256, np.int64))) for i in range(8)]

    def plan(budget, **kw):
        options = PassOptions(0, 64, activations=model, activation_budget=int(budget) + 1, **kw)
        return [(len(batch), ckpt) for batch, ckpt in plan_passes(rows, options)]

    everything = model.pass_bytes(8 * 256, 256, False, 64)
    assert plan(everything) == [(8, False)]                     # fits: one stored pass
    assert plan(everything / 3.5) == [(2, False)] * 4           # stored micro-batches of 512 tokens
    one_row = model.pass_bytes(256, 256, False, 64)
    small = plan(one_row)  # stored: one row (256 < 512 tokens); checkpointed ones hold more
    assert all(c for _, c in small) and small[0][0] > 1 and sum(n for n, _ in small) == 8
    assert plan(one_row, checkpointing=False) == [(1, False)] * 8
    assert plan(1) == [(1, True)] * 8                            # nothing fits: one row at a time, as lean as allowed
    token_rule = [(len(b), c) for b, c in plan_passes(rows, PassOptions(1024, 64, checkpoint_min_tokens=1024))]
    assert token_rule == [(4, True), (4, True)]  # the deprecated token rule: padded tokens alone decide
