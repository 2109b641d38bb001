"""The RL losses' ratio exp(lp - q) is taken of a capped log-ratio (losses.MAX_LOG_RATIO): for normal
inputs the losses are exactly a direct torch computation's, and so are their gradients (to rounding); for extreme inputs
that validation allows (sampler logprobs down to -1e6, advantages up to 1e6, config numbers up to
1e6) the loss and gradient stay finite, so the trainer never refuses what the scheduler accepted."""

import numpy as np
import pytest
import torch

from test_losses import make_datum
from test_trainer_engine import SPEC, run_wire
from temper.common.validation import LOSS_SPECS, MAX_LOSS_INPUT
from temper.services.models.loading import load_model
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.losses import LOSS_FNS, MAX_LOG_RATIO
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, types_pb2

RL_LOSSES = ["importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]


def _direct(loss_fn, lp, x, c):
    """Each loss as written in losses.py's docstring, with a plain torch.exp."""
    q, a = x["logprobs"], x["advantages"]
    pos = (a != 0) | (q != 0)

    def row_mean(v):
        return torch.where(pos, v, torch.zeros_like(v)).sum(-1, keepdim=True) / pos.sum(-1, keepdim=True).clamp(min=1)

    def clipped(r):
        return -torch.minimum(r * a, r.clamp(c["clip_low_threshold"], c["clip_high_threshold"]) * a)

    if loss_fn == "importance_sampling":
        return -torch.exp(lp - q) * a
    if loss_fn == "ppo":
        return clipped(torch.exp(lp - q))
    if loss_fn == "cispo":
        return -torch.exp(lp - q).clamp(c["clip_low_threshold"], c["clip_high_threshold"]).detach() * lp * a
    if loss_fn == "dro":
        return -(lp * a - 0.5 * c["beta"] * (lp - q) ** 2)
    if loss_fn == "gspo":
        return clipped(torch.exp(row_mean((lp - q).detach()) + lp - lp.detach()))
    w = torch.exp(row_mean((lp - q).detach())).clamp(c["clip_low_threshold"], c["clip_high_threshold"])
    kl = torch.where(pos, torch.exp(lp - q) - 1 - (lp - q), torch.zeros_like(lp))
    return -w * a * lp + c["kl_coeff"] * kl


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
@pytest.mark.parametrize("kl_coeff", [0.0, 0.3])
def test_normal_inputs_give_the_direct_loss_and_gradient(loss_fn, kl_coeff):
    g = torch.Generator().manual_seed(5)
    base = -torch.rand(3, 9, generator=g) * 8 - 0.1
    q = base + torch.randn(3, 9, generator=g) * 0.5          # a sampler near the current policy ...
    q[0, :4] = base[0, :4] - 15                              # ... and far below it (ratio ~ e^15)
    inputs = {"logprobs": q, "advantages": torch.randn(3, 9, generator=g)}
    config = {**LOSS_SPECS[loss_fn].config, **({"kl_coeff": kl_coeff} if loss_fn == "stable_reinforce" else {})}
    if loss_fn == "dro":
        config["beta"] = 0.3
    lp_got, lp_want = base.clone().requires_grad_(), base.clone().requires_grad_()
    got, _ = LOSS_FNS[loss_fn](lp_got, inputs, config)
    want = _direct(loss_fn, lp_want, inputs, config)
    assert torch.equal(got, want)  # bit for bit
    got.sum().backward()
    want.sum().backward()
    # the same math; autograd may add a gradient's paths in another order (last-bit rounding)
    scale = float(lp_want.grad.abs().max())
    torch.testing.assert_close(lp_got.grad, lp_want.grad, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
def test_a_log_ratio_past_the_cap_has_a_finite_loss_and_gradient(loss_fn):
    lp = torch.full((2, 5), -3.0, requires_grad=True)
    inputs = {"logprobs": torch.full((2, 5), -MAX_LOSS_INPUT), "advantages": torch.tensor([[MAX_LOSS_INPUT] * 5, [-MAX_LOSS_INPUT] * 5])}
    config = {**LOSS_SPECS[loss_fn].config}
    config.update({k: MAX_LOSS_INPUT for k in ("beta", "kl_coeff") if k in config})
    loss, stats = LOSS_FNS[loss_fn](lp, inputs, config)
    loss.sum().backward()
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(lp.grad).all())
    assert all(bool(torch.isfinite(v).all()) for v in stats.values())
    if "ratio" in stats and loss_fn not in ("gspo",):
        assert float(stats["ratio"].max()) == pytest.approx(float(np.exp(np.float32(MAX_LOG_RATIO))), rel=1e-6)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    eng = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(checkpoint_dir=tmp_path_factory.mktemp("ckpt")))
    eng.create_adapter("run", SPEC, seed=9)
    return eng


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
@pytest.mark.parametrize("sampler_logprob", [-100.0, -1e5, -MAX_LOSS_INPUT])
def test_extreme_but_valid_inputs_train_with_a_finite_loss(engine, loss_fn, sampler_logprob):
    tokens = [7, 19, 42, 101, 250, 33, 77]
    n = len(tokens) - 1
    for advantage in (MAX_LOSS_INPUT, -MAX_LOSS_INPUT):
        datum = make_datum(tokens[:-1], target_tokens=tokens[1:], logprobs=np.full(n, sampler_logprob, np.float32),
                           advantages=np.full(n, advantage, np.float32))
        config = {k: types_pb2.LossConfigValue(number=MAX_LOSS_INPUT) for k in ("beta", "kl_coeff") if k in LOSS_SPECS[loss_fn].config}
        item = trainer_pb2.ForwardBackwardItem(training_run_id="run", data=[datum], loss_fn=loss_fn, loss_fn_config=config)
        (result,), _ = run_wire(engine, [item])  # checked as the wire is, then the engine
        assert not isinstance(result, Exception), result
        assert np.isfinite(result.metrics["loss:sum"]) and all(np.isfinite(v) for v in result.metrics.values())
        adapter = engine.host.get("run")
        assert all(bool(torch.isfinite(p.grad).all()) for p in adapter.params.values() if p.grad is not None)
        adapter.optimizer.zero_grad(set_to_none=True)
