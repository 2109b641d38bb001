"""The recipes (recipes/rl_arithmetic.py, dpo.py, distill.py) end to end on the tiny model, a couple
of steps each, through the client against a real local stack: each must leave its final JSON line,
metrics JSONL and PNG. The tiny model's outputs are random, so nothing is ever scored correct: the
recipes must survive all-zero advantages; one test swaps in a reward that does vary so the RL
update path (datums → importance_sampling / ppo → optim_step) runs too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def run_recipe(name: str, tiny_model_dir: str, tmp_path: Path, *extra: str, api_key: str | None = None) -> tuple[dict, Path]:
    out = tmp_path / f"out-{name}"
    env = {**os.environ, "TEMPER_API_KEY": api_key} if api_key else None
    proc = subprocess.run(
        [sys.executable, "-m", f"recipes.{name}", "--base-model", tiny_model_dir, "--steps", "2", "--threads", "1",
         "--out-dir", str(out), "--data-dir", str(tmp_path / f"data-{name}"), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["recipe"] == name and summary["steps"] == 2 and summary["seconds"] > 0
    assert (out / "summary.json").is_file()
    return summary, out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG


def test_rl_arithmetic_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    summary, out = run_recipe("rl_arithmetic", tiny_model_dir, tmp_path, "--group-size", "2", "--batch-prompts", "2",
                              "--heldout", "4", "--eval-every", "1", "--max-tokens", "4")
    for key in ("heldout_reward_before", "heldout_reward_after", "heldout_reward_best", "evals", "train_reward_first",
                "train_reward_last5", "loss", "group_size", "batch_prompts", "learning_rate", "heldout", "plot", "metrics"):
        assert key in summary, key
    assert 0.0 <= summary["heldout_reward_before"] <= 1.0 and 0.0 <= summary["heldout_reward_after"] <= 1.0
    assert [s for s, _ in summary["evals"]] == [0, 1, 2]
    check_png(out / "rewards.png")
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1, 2]
    predictions = read_jsonl(out / "heldout_predictions.jsonl")
    assert [p["step"] for p in predictions] == [0] * 4 + [2] * 4


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo"])
def test_rl_arithmetic_updates_when_rewards_vary(tiny_model_dir, tmp_path, monkeypatch, capsys, loss):
    """With a reward that differs within groups, datums are built, trained and the importance
    ratio of fresh samples is 1 (sampler and trainer logprobs agree)."""
    from recipes import rl_arithmetic

    monkeypatch.setattr(rl_arithmetic, "reward", lambda text, a, b: float(len(text) % 2))
    out = tmp_path / "out"
    assert rl_arithmetic.main(["--base-model", tiny_model_dir, "--steps", "2", "--threads", "1", "--group-size", "4",
                               "--batch-prompts", "2", "--heldout", "2", "--eval-every", "2", "--max-tokens", "6",
                               "--loss", loss, "--out-dir", str(out), "--data-dir", str(tmp_path / "data")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["loss"] == loss
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert sum(r["datums"] for r in train) > 0
    trained = [r for r in train if r["datums"]]
    assert all(np.isfinite(r["loss"]) for r in trained)
    assert trained[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    check_png(out / "rewards.png")


def test_rl_datum_layout():
    from recipes.common import rl_datum

    d = rl_datum([1, 2, 3], [7, 8], [-0.5, -0.25], 0.75)
    assert d.model_input.to_ints() == [1, 2, 3, 7]
    np.testing.assert_array_equal(d.loss_fn_inputs["target_tokens"].to_numpy(), [2, 3, 7, 8])
    np.testing.assert_allclose(d.loss_fn_inputs["logprobs"].to_numpy(), [0, 0, -0.5, -0.25])
    np.testing.assert_allclose(d.loss_fn_inputs["advantages"].to_numpy(), [0, 0, 0.75, 0.75])
    per_token = rl_datum([1, 2], [7, 8, 9], [-1, -2, -3], [0.1, 0.2, 0.3])
    np.testing.assert_allclose(per_token.loss_fn_inputs["advantages"].to_numpy(), [0, 0.1, 0.2, 0.3], rtol=1e-6)


def test_dpo_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    summary, out = run_recipe("dpo", tiny_model_dir, tmp_path, "--batch-pairs", "2", "--max-heldout", "4", "--max-train", "8")
    for key in ("accuracy_before", "accuracy_after", "sft_accuracy_after", "preference_accuracy", "beta", "sft_weight",
                "dpo_loss_first", "dpo_loss_last10", "reward_accuracy_last10", "heldout", "train_pairs", "plot", "metrics"):
        assert key in summary, key
    assert summary["pairs"] == "judgment" and summary["heldout"] == 4 and summary["train_pairs"] == 8
    assert set(summary["preference_accuracy"]) == {"base", "dpo", "sft"}
    assert 0.0 <= summary["sft_accuracy_after"] <= 1.0
    # Before any update the policy is the reference: the DPO loss is log 2.
    assert summary["dpo_loss_first"] == pytest.approx(np.log(2), abs=1e-3)
    check_png(out / "dpo.png")
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["chosen_nll"] > 0 and r["sft_loss"] > 0 and r["policy_sft_loss"] > 0 for r in train)
    assert {r["run"] for r in rows if r["kind"] == "eval"} == {"base", "dpo", "sft"}
    predictions = read_jsonl(out / "heldout_predictions.jsonl")
    assert len(predictions) == 4 and all(p["logprob_A"] < 0 and p["logprob_B"] < 0 for p in predictions)


def test_verdict_only_dpo_plus_nll_without_the_sft_baseline_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    summary, out = run_recipe("dpo", tiny_model_dir, tmp_path, "--batch-pairs", "1", "--max-heldout", "2", "--max-train", "4",
                              "--sft-weight", "0.5", "--no-sft-baseline", "--verdict-only")
    assert summary["pairs"] == "verdict" and summary["sft_weight"] == 0.5 and summary["sft_accuracy_after"] is None
    assert summary["dpo_loss_first"] == pytest.approx(np.log(2), abs=1e-3)
    check_png(out / "dpo.png")


def test_dpo_loss_on_judgment_pairs_matches_a_direct_computation():
    import torch
    import torch.nn.functional as F

    from recipes.dpo import make_dpo_loss, pair_data

    pair = {"prompt": [5, 6, 7], "chosen": [11, 12, 2], "rejected": [13, 12, 2]}
    data = pair_data(pair)
    assert [d.loss_fn_inputs["target_tokens"].to_numpy().tolist() for d in data] == [[6, 7, 11, 12, 2], [6, 7, 13, 12, 2]]
    assert data[0].loss_fn_inputs["weights"].to_numpy().tolist() == [0, 0, 1, 1, 1]
    logprobs = [torch.tensor([-1.0, -2.0, -0.3, -0.2, -0.1], requires_grad=True),
                torch.tensor([-1.0, -2.0, -1.5, -0.4, -0.2], requires_grad=True)]
    refs = [(-0.9, -1.2)]
    beta = 0.5
    loss, metrics = make_dpo_loss(lambda: refs, beta)(data, logprobs)
    margin = beta * ((-0.6 + 0.9) - (-2.1 + 1.2))
    assert float(loss.detach()) == pytest.approx(float(-F.logsigmoid(torch.tensor(margin))), abs=1e-6)
    assert metrics["chosen_nll"] == pytest.approx(0.2, abs=1e-6)  # mean per-token NLL of the chosen completion
    loss.backward()
    assert torch.all(logprobs[0].grad[:2] == 0) and torch.all(logprobs[0].grad[2:] < 0)  # raise chosen
    assert torch.all(logprobs[1].grad[:2] == 0) and torch.all(logprobs[1].grad[2:] > 0)  # lower rejected


def test_dpo_plus_nll_adds_the_sft_objective_of_the_chosen_judgment():
    import torch
    import torch.nn.functional as F

    from recipes.common import shifted_datum
    from recipes.dpo import make_dpo_loss, pair_data

    pair = {"prompt": [5, 6, 7], "chosen": [11, 12, 2], "rejected": [13, 12, 2]}
    sft = shifted_datum([5, 6, 7, 11, 12, 2], [0, 0, 0, 0.5, 0.3, 0.2])
    logprobs = [torch.tensor([-1.0, -2.0, -0.3, -0.2, -0.1]), torch.tensor([-1.0, -2.0, -1.5, -0.4, -0.2])]
    loss, metrics = make_dpo_loss(lambda: [(-0.9, -1.2)], 0.5, sft_weight=2.0, sft_data=[sft])(pair_data(pair), logprobs)
    dpo = float(-F.logsigmoid(torch.tensor(0.5 * ((-0.6 + 0.9) - (-2.1 + 1.2)))))
    sft_loss = 0.5 * 0.3 + 0.3 * 0.2 + 0.2 * 0.1
    assert metrics["policy_sft_loss"] == pytest.approx(sft_loss, abs=1e-6)
    assert float(loss) == pytest.approx(dpo + 2.0 * sft_loss, abs=1e-6)


def test_verdict_dpo_loss_matches_a_direct_computation_and_its_gradient_lands_on_the_verdict():
    import torch
    import torch.nn.functional as F

    from recipes.dpo import make_dpo_loss, pair_data

    pair = {"prompt": [5, 6, 7, 8], "chosen": [11], "rejected": [12]}
    [datum] = pair_data(pair)
    targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
    assert targets.tolist() == [[6, 6], [7, 7], [8, 8], [11, 12]]
    assert datum.loss_fn_inputs["weights"].to_numpy().tolist() == [[0, 0], [0, 0], [0, 0], [1, 1]]
    logprobs = [torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-0.5, -0.5], [-0.3, -2.0]], requires_grad=True),
                torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-0.5, -0.5], [-1.5, -0.7]], requires_grad=True)]
    refs = [(-0.9, -0.8), (-1.1, -0.6)]
    beta = 0.5
    loss, metrics = make_dpo_loss(lambda: refs, beta)([datum, datum], logprobs)
    margins = [beta * ((-0.3 + 0.9) - (-2.0 + 0.8)), beta * ((-1.5 + 1.1) - (-0.7 + 0.6))]
    expected = -F.logsigmoid(torch.tensor(margins)).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-6)
    assert metrics["reward_accuracy"] == 0.5
    loss.backward()
    for lp in logprobs:
        assert torch.all(lp.grad[:-1] == 0) and torch.all(lp.grad[-1] != 0)
        assert float(lp.grad[-1, 0]) < 0 < float(lp.grad[-1, 1])  # raise chosen, lower rejected


def test_dpo_pairs_swap_the_answer():
    from recipes.dpo import swap_letters

    assert swap_letters("A's receipt shows tests passing; B's shows tests failing.") == \
        "B's receipt shows tests passing; A's shows tests failing."
    assert swap_letters("Only B has a receipt. AB stays.") == "Only A has a receipt. AB stays."


def test_distill_runs_on_the_tiny_model(tiny_model_dir, tmp_path):
    summary, out = run_recipe("distill", tiny_model_dir, tmp_path, "--batch-prompts", "2", "--group-size", "2",
                              "--heldout", "4", "--eval-samples", "1", "--eval-every", "1", "--max-tokens", "4")
    for key in ("teacher", "teacher_context", "reverse_kl_per_token_before", "reverse_kl_per_token_after",
                "reverse_kl_per_seq_before", "reverse_kl_per_seq_after", "exact_answer_before", "exact_answer_after",
                "heldout", "plot", "metrics"):
        assert key in summary, key
    assert summary["teacher_context"] == "fewshot"
    check_png(out / "distill.png")
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1, 2]
    assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-3) for r in rows if r["kind"] == "train")


def test_distill_from_a_checkpoint_teacher_on_a_running_stack(tiny_model_dir, tmp_path):
    """--address + --teacher-path: the teacher is a saved adapter on an already running stack."""
    from temper.client import ServiceClient
    from temper.localstack import LocalStack

    with LocalStack(tiny_model_dir, tmp_path / "stack", num_threads=1) as stack:
        address = stack.start()
        with stack.client() as client:
            teacher = client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
            path = teacher.save_weights_for_sampler("teacher").result().path
        summary, out = run_recipe("distill", tiny_model_dir, tmp_path, "--address", address, "--teacher-path", path,
                                  "--batch-prompts", "2", "--group-size", "2", "--heldout", "2", "--eval-samples", "1",
                                  "--eval-every", "2", "--max-tokens", "3", api_key=stack.api_key)
    assert summary["teacher"] == path and summary["teacher_context"] == "plain"
    check_png(out / "distill.png")


def test_rl_arithmetic_deterministic_is_exactly_on_policy(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Issue 23's proof in the recipe: in deterministic mode the sampler's logprobs are the trainer's
    bits, so every on-policy step reports kl_sample_train 0 and importance ratios of exactly 1 (the
    default mode above only agrees to ~1e-5)."""
    from recipes import rl_arithmetic

    monkeypatch.setattr(rl_arithmetic, "reward", lambda text, a, b: float(len(text) % 2))
    out = tmp_path / "out"
    assert rl_arithmetic.main(["--base-model", tiny_model_dir, "--steps", "2", "--threads", "1", "--group-size", "4",
                               "--batch-prompts", "2", "--heldout", "2", "--eval-every", "2", "--max-tokens", "6",
                               "--deterministic", "--out-dir", str(out), "--data-dir", str(tmp_path / "data")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["deterministic"] is True and summary["kl_sample_train_max"] == 0.0
    trained = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train" and r["datums"]]
    assert trained, "no step trained: the swapped-in reward should vary within groups"
    for row in trained:
        assert row["kl_sample_train"] == 0.0 and row["logprob_abs_diff"] == 0.0, row
        assert row["ratio_mean"] == 1.0 and row["ratio_max_dev"] == 0.0, row
