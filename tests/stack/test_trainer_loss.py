"""A trainer killed with SIGKILL, today (before trainer recovery): its runs' next requests answer a
clear FAILED_PRECONDITION — never NOT_FOUND for a run that exists, never a silently fresh adapter —
and a saved training checkpoint, loaded into a new run, carries on where it was."""

from __future__ import annotations

import pytest

from fixtures_stack import adapter_weights, assert_same_weights, sft_datum
from temper.client import AdamParams, FailedPrecondition

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
ADAM = AdamParams(learning_rate=1e-2)


def test_a_killed_trainers_runs_fail_clearly_and_resume_from_their_checkpoint(tiny_model_dir, new_postgres_database, tmp_path):
    from temper.localstack import LocalStack

    with LocalStack(tiny_model_dir, tmp_path / "stack", database_url=new_postgres_database("temper_loss"), num_threads=1) as stack:
        stack.start()
        with stack.client() as client:
            run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
            run.forward_backward([sft_datum(PATTERN)]).result()
            run.optim_step(ADAM).result()
            state = run.save_state("before").result().path
            stack.restart("trainer", crash=True)  # SIGKILL; same port, a new process without adapters
            with pytest.raises(FailedPrecondition, match="is gone from trainer"):
                run.forward_backward([sft_datum(PATTERN)]).result()

            resumed = client.create_lora_training_client(tiny_model_dir, rank=4, seed=9)
            resumed.load_state_with_optimizer(state).result()
            assert_same_weights(adapter_weights(client, resumed.save_state("resumed").result().path, tmp_path / "r"),
                                adapter_weights(client, state, tmp_path / "s"))
            resumed.forward_backward([sft_datum(PATTERN)]).result()
            assert resumed.optim_step(ADAM).result().metrics
