"""A trainer frozen (SIGSTOP) on real processes and Postgres (issue 21, edge 2): its sockets stay open
and nothing answers, so only deadlines and abandonment end the calls the scheduler has in flight to
it. With a snapshot after every step, the freeze lands in or right after a step's snapshot call; the
run's next requests must be answered by the other trainer while the frozen one is still frozen,
exactly once (request rows, step count, weights equal to a twin's), and the thawed trainer must not
disturb the run it lost. The precise in-snapshot and in-restore cases, on fakes:
``tests/unit/test_abandoned_calls.py``."""

from __future__ import annotations

import time

from fixtures_stack import request_rows, sft_datum
from test_faults import metric, wait_until
from test_scaleout import on_each_trainer
from test_trainer_loss import ADAM, DATA, assert_close_weights, run_field, train_alone

WORKER_TIMEOUT = 4.0


def test_a_frozen_trainer_holds_its_run_only_until_the_run_moves(tiny_model_dir, new_postgres_database, tmp_path):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_frozen_trainer")
    env = {"TEMPER_SCHEDULER_SNAPSHOT_EVERY_STEPS": "1", "TEMPER_SCHEDULER_WORKER_TIMEOUT_SECONDS": str(WORKER_TIMEOUT),
           "TEMPER_TRAINER_HEARTBEAT_SECONDS": "0.5", "TEMPER_SAMPLER_HEARTBEAT_SECONDS": "0.5"}
    with LocalStack(tiny_model_dir, tmp_path / "stack", database_url=url, num_threads=1, num_trainers=2, registration=True,
                    extra_env=env) as stack:
        stack.start()
        with stack.client() as client:
            run = on_each_trainer(stack, client, tiny_model_dir, seed=5, rank=4)["trainer"]
            for tokens in DATA[:2]:
                run.forward_backward([sft_datum(tokens)]).result(timeout=300)
                run.optim_step(ADAM).result(timeout=300)

            frozen = stack.service("trainer")
            stack.pause("trainer")  # the step's snapshot call follows its answer: frozen in it or just after
            try:
                started = time.monotonic()
                for tokens in DATA[2:4]:
                    run.forward_backward([sft_datum(tokens)]).result(timeout=120)
                    last = run.optim_step(ADAM).result(timeout=120)
                answered_in = time.monotonic() - started
                assert frozen.process.poll() is None  # answered while the trainer is frozen, not dead
                assert last.metrics["step:max"] == 4
                assert metric(stack.service("scheduler"), "temper_scheduler_trainers_down") == 1
            finally:
                stack.resume("trainer")

            # the thawed trainer finishes whatever it was doing; the run, now elsewhere, trains on once
            run.forward_backward([sft_datum(DATA[4])]).result(timeout=300)
            assert run.optim_step(ADAM).result(timeout=300).metrics["step:max"] == 5
            assert request_rows(url, run.model_id) == [(seq, "forward_backward" if seq % 2 else "optim_step", "done")
                                                       for seq in range(1, 11)]
            twin = train_alone(client, tiny_model_dir, DATA[:5], rank=4, seed=5)
            assert_close_weights(client, run, twin, tmp_path)
            # no unrecorded snapshot: one the thawed trainer finished after the call was given up is deleted
            recorded = run_field(url, run.model_id, "snapshot_key")
            folder = tmp_path / "stack" / "checkpoints" / run.model_id / "snapshots"
            wait_until(lambda: sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [recorded.rsplit("/", 1)[1]],
                       30, f"only the recorded snapshot {recorded} in {folder}")
            print(f"\nfour requests answered in {answered_in:.1f} s with the run's trainer frozen "
                  f"(worker timeout {WORKER_TIMEOUT:.0f} s)")
