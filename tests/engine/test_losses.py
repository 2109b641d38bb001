"""Every Tinker loss on the trainer against a direct torch computation (tiny model, fp32)."""

import re

import numpy as np
import pytest
import torch

from test_trainer_engine import SPEC, run_wire
from temper.common.codec import encode_array, encode_tokens
from temper.common.errors import InvalidArgument
from temper.common.validation import LOSS_SPECS, DecodedDatum
from temper.services.models.loading import load_model
from temper.services.trainer.engine import ForwardBackwardItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, types_pb2


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    eng = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(checkpoint_dir=tmp_path_factory.mktemp("ckpt"), logprob_chunk_tokens=7))
    eng.create_adapter("run", SPEC, seed=9)
    with torch.no_grad():  # a non-trivial adapter so every term matters
        for p in eng.host.get("run").params.values():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return eng


def domain_datum(tokens, **inputs) -> DecodedDatum:
    return DecodedDatum(tokens=np.asarray(tokens, np.int32),
                        inputs={k: np.asarray(v, np.int64 if k == "target_tokens" else np.float32) for k, v in inputs.items()})


def make_datum(tokens, **inputs):
    """As it arrives on the wire."""
    return types_pb2.Datum(
        model_input=types_pb2.ModelInput(chunks=[types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens)))]),
        loss_fn_inputs={k: encode_array(np.asarray(v), "int64" if k == "target_tokens" else "float32") for k, v in inputs.items()},
    )


def rl_data(seed):
    rng = np.random.default_rng(seed)
    out = []
    for n in (6, 11):
        tokens = rng.integers(0, 512, n + 1)
        out.append(dict(tokens=tokens[:-1], target_tokens=tokens[1:], logprobs=-rng.uniform(3, 9, n).astype(np.float32),
                        advantages=rng.standard_normal(n).astype(np.float32)))
    return out


def direct(engine, raw, objective):
    adapter = engine.host.get("run")
    for p in adapter.params.values():
        p.grad = None
    total, lps = 0.0, []
    for d in raw:
        with engine.lora.route([("run", None)]):
            logits = engine.loaded.model(input_ids=torch.tensor(d["tokens"][None], dtype=torch.long)).logits[0].float()
        logp = logits.log_softmax(-1)
        targets = torch.tensor(d["target_tokens"], dtype=torch.long)
        lp = logp.gather(-1, targets.reshape(len(targets), -1)).reshape(targets.shape)
        loss = objective(lp, {k: torch.tensor(v) for k, v in d.items() if k not in ("tokens", "target_tokens")}).sum()
        loss.backward()
        total += float(loss.detach())
        lps.append(lp.detach().numpy())
    grads = {n: p.grad.clone() for n, p in adapter.params.items()}
    for p in adapter.params.values():
        p.grad = None
    return total, lps, grads


def check(engine, raw, loss_fn, config, objective):
    data = [domain_datum(d["tokens"], **{k: v for k, v in d.items() if k != "tokens"}) for d in raw]
    want_loss, want_lp, want_grads = direct(engine, raw, objective)
    config = {**LOSS_SPECS[loss_fn].config, **config}  # a domain item carries the whole config, defaults included
    (result,), _ = engine.run_cycle([ForwardBackwardItem("run", data, loss_fn=loss_fn, loss_config=config)], [])
    assert result.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5, abs=1e-4)
    for got, want in zip(result.logprobs, want_lp):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)
    for name, p in engine.host.get("run").params.items():
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-5, rtol=1e-4)
        p.grad = None
    return result.metrics


def test_importance_sampling(engine):
    metrics = check(engine, rl_data(0), "importance_sampling", {}, lambda lp, x: -torch.exp(lp - x["logprobs"]) * x["advantages"])
    assert metrics["ratio:mean"] > 0


@pytest.mark.parametrize("lo, hi", [(0.8, 1.2), (0.5, 3.0)])
def test_ppo(engine, lo, hi):
    def objective(lp, x):
        r = torch.exp(lp - x["logprobs"])
        return -torch.minimum(r * x["advantages"], r.clamp(lo, hi) * x["advantages"])

    raw = rl_data(1)
    for d in raw:  # behaviour logprobs near the current ones, so some ratios fall inside the clip range
        d["logprobs"] = d["logprobs"] * 0 - 6.2
    metrics = check(engine, raw, "ppo", {"clip_low_threshold": lo, "clip_high_threshold": hi}, objective)
    assert 0.0 <= metrics["clip_fraction:mean"] <= 1.0


def test_cispo(engine):
    def objective(lp, x):
        return -torch.exp(lp - x["logprobs"]).clamp(0.0, 4.0).detach() * lp * x["advantages"]

    check(engine, rl_data(2), "cispo", {}, objective)


def test_dro(engine):
    check(engine, rl_data(3), "dro", {"beta": 0.3}, lambda lp, x: -(lp * x["advantages"] - 0.15 * (lp - x["logprobs"]) ** 2))


def test_top_k_cross_entropy(engine):
    rng = np.random.default_rng(4)
    raw = []
    for n, k in ((5, 3), (9, 3)):
        probs = rng.dirichlet(np.ones(k), n).astype(np.float32)
        raw.append(dict(tokens=rng.integers(0, 512, n), target_tokens=rng.integers(0, 512, (n, k)), weights=probs))
    check(engine, raw, "cross_entropy", {}, lambda lp, x: -lp * x["weights"])


@pytest.mark.parametrize(
    "loss_fn, inputs, config, match",
    [
        ("ppo", {"logprobs": [-1.0, -2.0], "advantages": [float("nan"), 1.0]}, {}, "NaN or infinite"),
        ("importance_sampling", {"logprobs": [-1.0, -2.0], "advantages": [float("inf"), 1.0]}, {}, "NaN or infinite"),
        ("importance_sampling", {"advantages": [1.0, 1.0]}, {}, "needs loss_fn_inputs"),
        ("ppo", {"logprobs": [-1.0, -2.0], "advantages": [1.0, 1.0]}, {"clip": 1.0}, "not used by ppo"),
        ("dro", {"logprobs": [[-1.0], [-2.0]], "advantages": [1.0, 1.0]}, {}, "shape"),
    ],
)
def test_bad_rl_inputs_are_rejected_before_anything_runs(engine, loss_fn, inputs, config, match):
    datum = make_datum([3, 4], target_tokens=[4, 5], **inputs)
    config_pb = {k: types_pb2.LossConfigValue(number=v) for k, v in config.items()}
    item = trainer_pb2.ForwardBackwardItem(training_run_id="run", data=[datum], loss_fn=loss_fn, loss_fn_config=config_pb)
    (refused,), _ = run_wire(engine, [item])  # the run's item is answered with the error; nothing ran
    assert isinstance(refused, InvalidArgument) and re.search(match, refused.message), refused
    assert all(p.grad is None for p in engine.host.get("run").params.values())
