"""gspo and stable_reinforce against a direct torch computation, and the ``ratio:mean`` /
``clip_fraction:mean`` metrics over the positions that carry loss (tiny model, fp32)."""

import numpy as np
import pytest
import torch

from test_losses import check, domain_datum, engine, make_datum  # noqa: F401  (engine: the module fixture)
from test_trainer_engine import run_wire
from temper.common.errors import InvalidArgument
from temper.common.validation import LOSS_SPECS
from temper.services.trainer.engine import ForwardBackwardItem
from temper.v1 import trainer_pb2, types_pb2

PROMPT = 4  # prompt targets per datum: sampler logprob 0 and advantage 0, as the cookbook pads them


def current_logprobs(engine, raw):
    data = [domain_datum(d["tokens"], target_tokens=d["target_tokens"], weights=np.ones(len(d["tokens"]))) for d in raw]
    (result,), _ = engine.run_cycle([ForwardBackwardItem("run", data, loss_fn="cross_entropy", forward_only=True)], [])
    return result.logprobs


def padded_rl_data(seed, engine=None, jitter=0.0):
    """Datums whose first PROMPT targets are prompt padding. Sampler logprobs: spread like
    test_losses.rl_data, or with ``engine``, the trainer's own plus N(0, jitter) noise, so sequence
    ratios fall near 1 and the clip thresholds matter."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (7, 12):
        tokens = rng.integers(0, 512, n + 1)
        q = -rng.uniform(3, 9, n).astype(np.float32)
        adv = np.repeat(rng.standard_normal(1), n).astype(np.float32)  # one advantage per sequence
        q[:PROMPT], adv[:PROMPT] = 0.0, 0.0
        out.append(dict(tokens=tokens[:-1], target_tokens=tokens[1:], logprobs=q, advantages=adv))
    if engine is not None:
        for d, lp in zip(out, current_logprobs(engine, out)):
            d["logprobs"][PROMPT:] = lp[PROMPT:] + rng.normal(0, jitter, len(lp) - PROMPT).astype(np.float32)
    return out


def sampled(x):
    return (x["advantages"] != 0) | (x["logprobs"] != 0)


def gspo_objective(lo, hi):
    def objective(lp, x):
        m = (x["sequence_ratio_mask"] != 0) if "sequence_ratio_mask" in x else sampled(x)
        s = torch.exp((lp.detach() - x["logprobs"])[m].mean())
        r = s * torch.exp(lp - lp.detach())
        return -torch.minimum(r * x["advantages"], r.clamp(lo, hi) * x["advantages"])
    return objective


@pytest.mark.parametrize("seed, jitter, lo, hi", [(5, 0.05, 0.8, 1.2), (5, 0.05, 0.99, 1.01), (11, 0.3, 0.9, 1.1),
                                                  (6, 0.002, 1 - 3e-4, 1 + 4e-4)])
def test_gspo(engine, seed, jitter, lo, hi):
    raw = padded_rl_data(seed, engine, jitter)
    ratio_mask = np.zeros(len(raw[0]["logprobs"]), np.float32)
    ratio_mask[PROMPT + 1:] = 1.0  # a mask narrower than the sampled tokens: it, not they, decides
    raw[0]["sequence_ratio_mask"] = ratio_mask  # the second datum has none: its sampled tokens are used
    config = {} if (lo, hi) == (1 - 3e-4, 1 + 4e-4) else {"clip_low_threshold": lo, "clip_high_threshold": hi}
    metrics = check(engine, raw, "gspo", config, gspo_objective(lo, hi))
    assert 0.0 <= metrics["clip_fraction:mean"] <= 1.0


def test_gspo_far_off_policy(engine):  # sampler logprobs unrelated to the model's
    check(engine, padded_rl_data(6), "gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, gspo_objective(0.5, 2.0))


def stable_reinforce_objective(lo, hi, kl_coeff):
    def objective(lp, x):
        p = sampled(x)
        diff = lp - x["logprobs"]
        w = torch.exp(diff.detach()[p].mean()).clamp(lo, hi)
        kl = torch.where(p, torch.exp(diff) - 1 - diff, torch.zeros_like(diff))
        return -w * x["advantages"] * lp + kl_coeff * kl
    return objective


@pytest.mark.parametrize("jitter, config, lo, hi, kl_coeff", [
    (0.3, {}, 0.0, 2.0, 0.0),                                         # defaults
    (0.3, {"kl_coeff": 0.1}, 0.0, 2.0, 0.1),
    (0.3, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05, "kl_coeff": 0.05}, 0.9, 1.05, 0.05),
    (None, {"clip_low_threshold": 0.2, "clip_high_threshold": 1.5, "kl_coeff": 0.05}, 0.2, 1.5, 0.05),  # far off-policy
])
def test_stable_reinforce(engine, jitter, config, lo, hi, kl_coeff):
    raw = padded_rl_data(7, engine if jitter is not None else None, jitter or 0.0)
    metrics = check(engine, raw, "stable_reinforce", config, stable_reinforce_objective(lo, hi, kl_coeff))
    assert {"ratio:mean", "clip_fraction:mean", "kl:mean"} <= set(metrics)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"])
def test_on_policy_ratio_is_one_despite_prompt_padding(engine, loss_fn):
    """Sampler logprobs equal to the trainer's on the sampled targets, 0 on the prompt targets: the
    ratio averages over the sampled targets only (over all targets it read about 0.25)."""
    raw = padded_rl_data(8, engine)
    data = [domain_datum(d["tokens"], **{k: v for k, v in d.items() if k != "tokens"}) for d in raw]
    item = ForwardBackwardItem("run", data, loss_fn=loss_fn, loss_config=dict(LOSS_SPECS[loss_fn].config), forward_only=True)
    (result,), _ = engine.run_cycle([item], [])
    assert result.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-4)
    if "clip_fraction:mean" in result.metrics:
        assert result.metrics["clip_fraction:mean"] == 0.0


def test_ratio_mean_counts_only_sampled_targets(engine):
    """Off-policy by a known amount on the sampled targets: the metric is their mean ratio."""
    raw = padded_rl_data(9, engine)
    for d in raw:
        d["logprobs"][PROMPT:] += np.log(2.0)  # ratio exactly 1/2 there
    data = [domain_datum(d["tokens"], **{k: v for k, v in d.items() if k != "tokens"}) for d in raw]
    (result,), _ = engine.run_cycle([ForwardBackwardItem("run", data, loss_fn="importance_sampling", forward_only=True)], [])
    assert result.metrics["ratio:mean"] == pytest.approx(0.5, abs=1e-4)


@pytest.mark.parametrize("loss_fn, inputs, config, match", [
    ("gspo", {"sequence_ratio_mask": [1.0, float("nan")]}, {}, "NaN or infinite"),
    ("gspo", {"sequence_ratio_mask": [[1.0], [1.0]]}, {}, "shape"),
    ("stable_reinforce", {}, {"kl_coeff": -1.0}, "kl_coeff >= 0"),
    ("stable_reinforce", {}, {"beta": 1.0}, "not used by stable_reinforce"),
    ("stable_reinforce", {"sequence_ratio_mask": [1.0, 1.0]}, {}, "unknown loss_fn_inputs"),
    ("gspo", {}, {"clip_low_threshold": 1.1, "clip_high_threshold": 1.0}, "clip_low_threshold <= clip_high_threshold"),
])
def test_bad_inputs_are_rejected(engine, loss_fn, inputs, config, match):
    datum = make_datum([3, 4], target_tokens=[4, 5], logprobs=[-1.0, -2.0], advantages=[1.0, 1.0], **inputs)
    config_pb = {k: types_pb2.LossConfigValue(number=v) for k, v in config.items()}
    item = trainer_pb2.ForwardBackwardItem(training_run_id="run", data=[datum], loss_fn=loss_fn, loss_fn_config=config_pb)
    (refused,), _ = run_wire(engine, [item])
    assert isinstance(refused, InvalidArgument) and match in refused.message, refused
