"""The DPO and distillation recipes (recipes/dpo.py, distill.py) end to end on the tiny model, a
couple of steps each, through the client against a real local stack: each must leave its final JSON
line, metrics JSONL and PNG (recipe_runs.py runs them); their losses against a direct computation."""

from __future__ import annotations

import numpy as np
import pytest

from recipe_runs import run_recipe, read_jsonl, check_png


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
