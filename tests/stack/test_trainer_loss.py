"""A trainer killed with SIGKILL, on the real stack and Postgres.

With trainer recovery on (the default): a trainer that comes back on its address without adapters,
or that stays dead while another trainer of the model answers, loses nothing acknowledged — every
call eventually succeeds and the run's weights equal a twin's trained alone on a trainer nobody
killed. With it off: the runs' next requests answer a clear FAILED_PRECONDITION (never NOT_FOUND for
a run that exists, never a silently fresh adapter), and a saved training checkpoint, loaded into a
new run, carries on where it was."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import adapter_weights, assert_same_weights, request_rows, sft_datum
from temper.client import AdamParams, FailedPrecondition
from test_faults import ROUNDS, metric
from test_scaleout import on_each_trainer

PATTERN = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
ADAM = AdamParams(learning_rate=1e-2)
DATA = [*ROUNDS, [9, 8, 7, 6, 5, 4, 3, 2], [400, 401, 402, 403, 404, 405]]  # 8 rounds of fb + optim_step


def train_alone(client, base_model, rounds, **lora):
    """The twin: a new run trained one request at a time on a trainer nobody kills meanwhile."""
    twin = client.create_lora_training_client(base_model, **lora)
    for tokens in rounds:
        twin.forward_backward([sft_datum(tokens)]).result(timeout=300)
        twin.optim_step(ADAM).result(timeout=300)
    return twin


def assert_close_weights(client, a, b, tmp_path) -> None:
    names = [f"w-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    got, want = (adapter_weights(client, tc.save_weights_for_sampler(name).result(timeout=300).path, tmp_path / name)
                 for name, tc in zip(names, (a, b)))
    assert got.keys() == want.keys() and any(np.abs(v).max() > 0 for k, v in want.items() if "lora_B" in k)
    for key in got:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)


def run_field(url: str, run_id: str, column: str):
    """One column of the run's training_runs row, read from the database."""
    engine = create_engine(url)
    with engine.connect() as conn:
        value = conn.execute(text(f"select {column} from training_runs where id = :r"), {"r": run_id}).scalar_one()
    engine.dispose()
    return value


def placed_on(url: str, run_id: str) -> str:
    return run_field(url, run_id, "trainer")


def test_a_trainer_killed_mid_stream_comes_back_and_its_run_goes_on_exactly(tiny_model_dir, new_postgres_database, tmp_path):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_loss")
    env = {"TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS": "2"}
    with LocalStack(tiny_model_dir, tmp_path / "stack", database_url=url, num_threads=1, extra_env=env) as stack:
        stack.start()
        with stack.client() as client:
            run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
            for tokens in DATA[:3]:  # steps at seqs 2, 4, 6: a snapshot after seq 4, seqs 5-6 acknowledged after it
                run.forward_backward([sft_datum(tokens)]).result(timeout=300)
                run.optim_step(ADAM).result(timeout=300)
            seedless = client.create_lora_training_client(tiny_model_dir, rank=4)  # snapshotted at creation
            before = seedless.save_weights_for_sampler("before").result(timeout=300).path
            pending = [f for tokens in DATA[3:] for f in (run.forward_backward([sft_datum(tokens)]), run.optim_step(ADAM))]
            stack.restart("trainer", crash=True)  # SIGKILL while they run; same port, a new process without adapters
            outputs = [f.result(timeout=600) for f in pending]  # every call succeeds, some late
            assert all(o.metrics for o in outputs)
            assert metric(stack.service("scheduler"), 'temper_scheduler_runs_restored_total{outcome="restored"}') >= 1
            assert request_rows(url, run.model_id) == [(seq, "forward_backward" if seq % 2 else "optim_step", "done")
                                                       for seq in range(1, 2 * len(DATA) + 1)]
            assert outputs[-1].metrics["step:max"] == len(DATA)  # the adapter's own step count: none lost, none twice
            twin = train_alone(client, tiny_model_dir, DATA, rank=4, seed=2)
            assert_close_weights(client, run, twin, tmp_path)
            # a random initialisation comes back from its creation snapshot, bit for bit
            after = seedless.save_weights_for_sampler("after").result(timeout=300).path
            assert_same_weights(adapter_weights(client, after, tmp_path / "after"), adapter_weights(client, before, tmp_path / "before"))


def test_the_runs_of_a_trainer_that_stays_dead_move_to_the_other_and_go_on_exactly(tiny_model_dir, new_postgres_database,
                                                                                   tmp_path):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_loss")
    env = {"TEMPER_SCHEDULER_DISPATCH_RETRY_SECONDS": "2"}
    with LocalStack(tiny_model_dir, tmp_path / "stack", database_url=url, num_threads=1, num_trainers=2, extra_env=env) as stack:
        stack.start()
        with stack.client() as client:
            runs = on_each_trainer(stack, client, tiny_model_dir, seed=5, rank=4)
            for tokens in DATA[:3]:
                for tc in runs.values():
                    tc.forward_backward([sft_datum(tokens)]).result(timeout=300)
                    tc.optim_step(ADAM).result(timeout=300)
            stack.service("trainer-1").process.kill()  # and not restarted
            stack.service("trainer-1").process.wait(timeout=30)
            pending = [f for tokens in DATA[3:] for tc in runs.values()
                       for f in (tc.forward_backward([sft_datum(tokens)]), tc.optim_step(ADAM))]
            assert all(f.result(timeout=600).metrics for f in pending)
            survivor = stack.service("trainer").address
            assert placed_on(url, runs["trainer-1"].model_id) == survivor  # moved, durably
            assert metric(stack.service("scheduler"), 'temper_scheduler_runs_restored_total{outcome="restored"}') >= 1
            twin = train_alone(client, tiny_model_dir, DATA, rank=4, seed=5)
            for tc in runs.values():
                assert_close_weights(client, tc, twin, tmp_path)


def test_with_recovery_off_a_killed_trainers_runs_fail_clearly_and_resume_from_their_checkpoint(tiny_model_dir,
                                                                                                new_postgres_database, tmp_path):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_loss")
    with LocalStack(tiny_model_dir, tmp_path / "stack", database_url=url, num_threads=1,
                    extra_env={"TEMPER_SCHEDULER_RECOVERY": "off"}) as stack:
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
