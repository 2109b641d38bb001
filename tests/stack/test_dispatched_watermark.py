"""The dispatched watermark (request_log.py, migration 0017) in place of per-row "running" marks.

A row still "queued" at or below its run's ``training_runs.dispatched_seq`` may have been applied: after
a crash between dispatch and finish it is answered exactly as a "running" row was (not skipped, queued
again on its row when resent, the trainer answering it from memory). And the rows a verb writes, counted
on PostgreSQL through a real scheduler."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import store_with_run, adapter_weights, raw_stub, request_rows, sft_datum
from temper.client import AdamParams, convert
from temper.localstack import LocalStack
from temper.scheduler.db.request_log import NewRequest
from temper.scheduler.db.store import Store
from temper.scheduler.planning.admission import _answer_from_record, stored_answer
from temper.v1 import service_pb2

ADAM = AdamParams(learning_rate=5e-3, eps=1e-8)
TOKENS = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]


def _raw(url: str, sql: str, **params):
    engine = create_engine(url)
    with engine.begin() as conn:
        rows = conn.execute(text(sql), params).all()
    engine.dispose()
    return rows


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_rows_under_the_watermark_read_as_running_after_a_crash(backend, new_postgres_database, tmp_path):
    url = new_postgres_database("temper_watermark") if backend == "postgresql" else f"sqlite:///{tmp_path / 'wm.db'}"
    store, run_id = store_with_run(url)
    store.add_requests([NewRequest(run_id, 1, "forward_backward", "sha1", "queued", 6, payload=b"p1"),
                        NewRequest(run_id, 2, "optim_step", "sha2", "queued", 0, payload=b"p2")])
    # the lane's first cycle (seqs 1, 2) marked with the rows admitted meanwhile (3, 4): the request writer's group
    assert store.write_group([NewRequest(run_id, 3, "forward_backward", "sha3", "queued", 6),
                              NewRequest(run_id, 4, "forward_backward", "sha4", "queued", 6)], [(run_id, 1), (run_id, 2)]) == [None, None]
    # no request row was rewritten: the marks are the run's watermark
    assert _raw(url, "select seq_id, status from requests order by seq_id") == [(1, "queued"), (2, "queued"), (3, "queued"), (4, "queued")]
    assert _raw(url, "select dispatched_seq from training_runs")[0][0] == 2
    store.engine.dispose()

    store = Store(url)  # the scheduler crashed before the cycle's finish: a new process reads the rows
    assert [store.get_request(run_id, s).status for s in (1, 2, 3, 4)] == ["running", "running", "queued", "queued"]
    one = store.get_request(run_id, 1)
    assert stored_answer(one) is None and _answer_from_record(one, "sha1") is None  # queued again on its row, as resent
    assert store.skip_request(run_id, 2, queued_too=True) == "running"  # may have been applied: its client cannot skip it
    assert store.skip_request(run_id, 4, queued_too=True) == "skipped"  # never left the scheduler
    assert [(r.seq_id, r.status) for r in store.logged_requests(run_id, 0, 4)] == [
        (1, "running"), (2, "running"), (3, "queued"), (4, "skipped")]
    store.mark_running([(run_id, 1)])  # an older mark never moves the watermark down
    assert store.get_request(run_id, 2).status == "running"

    # the resent cycle's outcomes, recorded (open rows) with seq 3 marked for the next cycle, then resent: counted once
    for _ in range(2):
        store.finish_requests([(run_id, 1, "done", None, b"fb1"), (run_id, 2, "done", None, b"step")], {run_id: 6}, {run_id: 1},
                              {run_id: 3}, result_window=8, running=[(run_id, 3)])
    assert [store.get_request(run_id, s).status for s in (1, 2, 3)] == ["done", "done", "running"]
    assert _raw(url, "select tokens_trained, steps, next_seq_id, dispatched_seq from training_runs")[0] == (6, 1, 3, 3)
    store.engine.dispose()


def test_work_dispatched_before_a_crash_is_answered_once(tiny_model_dir, new_postgres_database, tmp_path):
    """A real scheduler killed after an optim step reached the trainer and before its outcome was
    recorded, its row left "queued" under the run's watermark (what the loop leaves now): the resend is
    answered from the trainer's memory, not applied twice (a twin run that stepped once is bit-identical)."""
    url = new_postgres_database("temper_watermark_crash")
    with LocalStack(tiny_model_dir, tmp_path / "stack", database_url=url, num_threads=1) as local:
        local.address = local.start()
        client = local.client()
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=4)
        twin = client.create_lora_training_client(tiny_model_dir, rank=4, seed=4)
        stub = raw_stub(local)
        step = service_pb2.OptimStepRequest(training_run_id=run.model_id, seq_id=2, adam_params=convert.adam_to_proto(ADAM))
        stub.ForwardBackward(service_pb2.ForwardBackwardRequest(
            training_run_id=run.model_id, seq_id=1, data=[convert.datum_to_proto(sft_datum(TOKENS))], loss_fn="cross_entropy"))
        first_answer = stub.OptimStep(step)
        twin.forward_backward([sft_datum(TOKENS)]).result()
        twin.optim_step(ADAM).result()
        twin_path = twin.save_weights_for_sampler("after").result().path

        local.service("scheduler").process.kill()
        _raw(url, "update requests set status = 'queued', result = null, finished_at = null "
                  "where training_run_id = :r and seq_id = 2 returning seq_id", r=run.model_id)
        _raw(url, "update training_runs set next_seq_id = 2, steps = 0, dispatched_seq = 2 where id = :r returning id", r=run.model_id)
        assert request_rows(url, run.model_id) == [(1, "forward_backward", "done"), (2, "optim_step", "running")]
        local.address = local.restart_scheduler(crash=True)

        reader, stub = local.client(), raw_stub(local)
        assert stub.OptimStep(step) == first_answer  # resent: the trainer answers from memory, no second step
        saved = stub.SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=run.model_id, seq_id=3, name="after", kind=1))
        a = adapter_weights(reader, saved.checkpoint.path, tmp_path)
        b = adapter_weights(reader, twin_path, tmp_path)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        assert request_rows(url, run.model_id) == [
            (1, "forward_backward", "done"), (2, "optim_step", "done"), (3, "save_weights", "done")]
        reader.close()
        client.close()


# Every row written to the hot path's tables, logged by triggers (exact and synchronous, unlike
# pg_stat_user_tables, whose counters reach the view only when a backend reports them).
_LOG_WRITES = """
CREATE TABLE row_writes (tbl text, op text, status text);
CREATE FUNCTION log_row_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO row_writes VALUES (TG_TABLE_NAME, TG_OP, to_jsonb(NEW) ->> 'status');  -- training_runs has none: NULL
  RETURN NULL;
END $$;
CREATE TRIGGER log_requests AFTER INSERT OR UPDATE ON requests FOR EACH ROW EXECUTE FUNCTION log_row_write();
CREATE TRIGGER log_metrics AFTER INSERT OR UPDATE ON run_metrics FOR EACH ROW EXECUTE FUNCTION log_row_write();
CREATE TRIGGER log_runs AFTER INSERT OR UPDATE ON training_runs FOR EACH ROW EXECUTE FUNCTION log_row_write();
"""
RESULTS_KEPT = 4  # durable_results_per_run, small: the result cut (one older row's update per verb) is in the count


def test_rows_written_per_verb_through_a_real_scheduler(tiny_model_dir, new_postgres_database, tmp_path):
    """How rows are counted: one INSERT or UPDATE of one row is one write. Per verb (forward_backward or
    optim_step): its request row's insert and its outcome's update, its run_metrics row, and once the
    run is past its kept results one older row's result cut. Per cycle, shared by its verbs: its run's
    training_runs row (counters and the next cycle's watermark in one update; a second when the
    watermark moves in the request writer's transaction instead). No request row is set "running"."""
    url = new_postgres_database("temper_row_writes")
    env = {"TEMPER_SCHEDULER_DURABLE_RESULTS_PER_RUN": str(RESULTS_KEPT), "TEMPER_SCHEDULER_RECOVERY": "off"}
    with LocalStack(tiny_model_dir, tmp_path / "stack", database_url=url, num_threads=1, extra_env=env) as local:
        local.address = local.start()
        client = local.client()
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
        run.forward_backward([sft_datum(TOKENS)]).result()
        run.optim_step(ADAM).result()  # warm: seqs 1, 2
        _raw(url, _LOG_WRITES + "SELECT 1")

        verbs = 0
        for _ in range(6):  # pipelined: three forward_backward and a step in flight, so cycles hold several verbs
            pending = [run.forward_backward([sft_datum(TOKENS)]) for _ in range(3)] + [run.optim_step(ADAM)]
            for future in pending:
                future.result(timeout=120)
            verbs += len(pending)
        client.close()
        writes = _raw(url, "select tbl, op, status from row_writes")
        cycles = _raw(url, "select count(distinct cycle) from run_metrics where training_run_id = :r and seq_id > 2", r=run.model_id)[0][0]

    count = lambda tbl, op=None: sum(1 for t, o, _ in writes if t == tbl and (op is None or o == op))  # noqa: E731
    assert count("requests", "INSERT") == verbs
    assert count("run_metrics", "INSERT") == verbs and count("run_metrics") == verbs
    assert not [s for t, o, s in writes if t == "requests" and o == "UPDATE" and s == "running"]
    # an outcome per verb, and a result cut per verb past the first RESULTS_KEPT seqs: no other request row write
    # (the warm-up's two results are cut in the measured part too: the window is larger than two)
    cut = _raw(url, "select count(*) from requests where training_run_id = :r and result is null", r=run.model_id)[0][0]
    assert count("requests", "UPDATE") == verbs + cut and cut <= verbs + 2
    assert count("training_runs") <= 2 * cycles and count("training_runs", "INSERT") == 0
    per_verb = (count("requests") + count("run_metrics")) / verbs
    print(f"{verbs} verbs in {cycles} cycles: {per_verb:.2f} rows per verb (requests + run_metrics), "
          f"{count('training_runs') / cycles:.2f} training_runs updates per cycle")
    assert per_verb <= 4
