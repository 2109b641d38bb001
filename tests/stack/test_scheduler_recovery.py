"""What the scheduler does when things go wrong around a run's seq order, on the real stack and
Postgres: a scheduler process that dies (SIGKILL) and is restarted on the same port and database
while the trainer keeps its adapters (accepted work is not lost; work whose outcome the crash made
unknown is reported as such instead of being run twice or blocking the run), and a seq that never
arrives (the run's later work goes on after TEMPER_SCHEDULER_SEQ_GAP_TIMEOUT_SECONDS)."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fixtures_stack import adapter_weights, request_rows, sft_datum, raw_stub
from temper.client import AdamParams, ServiceClient, convert
from temper.localstack import LocalStack
from temper.v1 import service_pb2, service_pb2_grpc

FIRST = [7, 19, 42, 101, 250, 33, 77, 5, 310, 64, 128, 12]
SECOND = [3, 9, 27, 81, 243, 217, 139, 5, 15, 45, 135, 405]
ADAM = AdamParams(learning_rate=5e-3, eps=1e-8)


def start_stack(tiny_model_dir, postgres_url, folder, **env):
    local = LocalStack(tiny_model_dir, folder, database_url=postgres_url, num_threads=1, extra_env=env)
    local.address = local.start()
    return local


@pytest.fixture
def own_stack(tiny_model_dir, postgres_url, tmp_path):
    """A stack of its own: the session's shared stack is not killed under the other tests."""
    with start_stack(tiny_model_dir, postgres_url, tmp_path / "stack") as local:
        yield local


def fb_request(run_id: str, seq: int, tokens: list[int]) -> service_pb2.ForwardBackwardRequest:
    return service_pb2.ForwardBackwardRequest(training_run_id=run_id, seq_id=seq, data=[convert.datum_to_proto(sft_datum(tokens))],
                                              loss_fn="cross_entropy")


def wait_for_rows(url: str, run_id: str, expected: list[tuple], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while request_rows(url, run_id) != expected:
        assert time.monotonic() < deadline, request_rows(url, run_id)
        time.sleep(0.05)


def sql(url: str, statement: str, **params) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(statement), params)
    engine.dispose()


def crash_while_running(stack: LocalStack, url: str, run_id: str, seq: int) -> None:
    """Kill the scheduler and leave the database as a crash between "sent to the trainer" and "answer
    recorded" would: request ``seq`` marked running (the loop does so before dispatching), no answer,
    the run's next seq and counters not yet past it; then start a new scheduler."""
    stack.service("scheduler").process.kill()
    sql(url, "update requests set status = 'running', result = null where training_run_id = :r and seq_id = :s", r=run_id, s=seq)
    sql(url, "update training_runs set next_seq_id = :s, steps = 0 where id = :r", r=run_id, s=seq)
    stack.restart_scheduler(crash=True)


def test_queued_request_survives_a_scheduler_crash_and_runs_once(own_stack, tiny_model_dir, postgres_url, tmp_path):
    client = own_stack.client()
    crashed = client.create_lora_training_client(tiny_model_dir, rank=4, seed=3)
    twin = client.create_lora_training_client(tiny_model_dir, rank=4, seed=3)

    held_back = crashed._next_seq()  # seq 1 is not sent yet, so seq 2 is accepted and must wait for it
    pending = crashed.forward_backward([sft_datum(SECOND)])
    wait_for_rows(postgres_url, crashed.model_id, [(2, "forward_backward", "queued")])

    own_stack.restart_scheduler(crash=True)
    # The client resends seq 2 to the new process by itself (UNAVAILABLE is retried); the row says it
    # never reached a trainer, so it is queued again and runs once seq 1 arrives.
    stub = raw_stub(own_stack)
    first = stub.ForwardBackward(fb_request(crashed.model_id, held_back, FIRST))
    second = pending.result(timeout=120)
    crashed.optim_step(ADAM).result()

    twin_first = twin.forward_backward([sft_datum(FIRST)]).result()
    twin_second = twin.forward_backward([sft_datum(SECOND)]).result()
    twin.optim_step(ADAM).result()
    assert first.metrics["loss:sum"] == pytest.approx(twin_first.metrics["loss:sum"], abs=1e-5)
    assert second.metrics["loss:sum"] == pytest.approx(twin_second.metrics["loss:sum"], abs=1e-5)
    np.testing.assert_allclose(second.loss_fn_outputs[0]["logprobs"].to_numpy(), twin_second.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-5)
    # Had seq 2 run twice, the crashed run's step would have used a doubled gradient.
    paths = [run.save_weights_for_sampler("after").result().path for run in (crashed, twin)]
    a, b = (adapter_weights(client, p, tmp_path) for p in paths)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-6, err_msg=key)
    assert request_rows(postgres_url, crashed.model_id) == [
        (1, "forward_backward", "done"), (2, "forward_backward", "done"), (3, "optim_step", "done"), (4, "save_weights", "done")]
    client.close()


def test_work_that_reached_the_trainer_before_a_crash_is_answered_once(own_stack, tiny_model_dir, postgres_url, tmp_path):
    client = own_stack.client()
    run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=4)
    twin = client.create_lora_training_client(tiny_model_dir, rank=4, seed=4)
    stub = raw_stub(own_stack)
    step = service_pb2.OptimStepRequest(training_run_id=run.model_id, seq_id=2, adam_params=convert.adam_to_proto(ADAM))
    stub.ForwardBackward(fb_request(run.model_id, 1, FIRST))
    first_answer = stub.OptimStep(step)
    twin.forward_backward([sft_datum(FIRST)]).result()
    twin.optim_step(ADAM).result()
    crash_while_running(own_stack, postgres_url, run.model_id, 2)

    stub = raw_stub(own_stack)
    assert stub.OptimStep(step) == first_answer  # re-sent; the trainer answers from memory, no second step
    saved = stub.SaveWeights(service_pb2.SaveWeightsRequest(training_run_id=run.model_id, seq_id=3, name="after", kind=1))
    a = adapter_weights(client, saved.checkpoint.path, tmp_path)
    b = adapter_weights(client, twin.save_weights_for_sampler("after").result().path, tmp_path)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # one step each: bit-identical
    assert request_rows(postgres_url, run.model_id) == [
        (1, "forward_backward", "done"), (2, "optim_step", "done"), (3, "save_weights", "done")]
    client.close()


def test_an_interrupted_save_completes_when_its_client_resends_it(own_stack, tiny_model_dir, postgres_url):
    client = own_stack.client()
    run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=7)
    run.forward_backward([sft_datum(FIRST)]).result()
    first = run.save_weights_for_sampler("maybe").result()
    # The scheduler dies with the save on the trainer (its files written, the answer not recorded)
    crash_while_running(own_stack, postgres_url, run.model_id, 2)

    stub = raw_stub(own_stack)
    retry = service_pb2.SaveWeightsRequest(training_run_id=run.model_id, seq_id=2, name="maybe", kind=1)
    saved = stub.SaveWeights(retry)  # run again: late, not failed; the files it finds are the first attempt's
    assert saved.checkpoint.path == first.path
    out = run.forward_backward([sft_datum(SECOND)]).result(timeout=60)
    assert np.isfinite(out.metrics["loss:sum"])
    assert request_rows(postgres_url, run.model_id) == [
        (1, "forward_backward", "done"), (2, "save_weights", "done"), (3, "forward_backward", "done")]
    client.close()


def test_a_seq_that_never_arrives_is_skipped_after_the_gap_timeout(tiny_model_dir, postgres_url, tmp_path):
    with start_stack(tiny_model_dir, postgres_url, tmp_path / "stack", TEMPER_SCHEDULER_SEQ_GAP_TIMEOUT_SECONDS="1") as local:
        client = local.client()
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=5)
        never_sent = run._next_seq()  # a client that took seq 1 and died before sending it
        started = time.monotonic()
        out = run.forward_backward([sft_datum(SECOND)]).result(timeout=60)
        assert time.monotonic() - started >= 1.0  # it waited for seq 1 first
        assert np.isfinite(out.metrics["loss:sum"])
        stub = raw_stub(local)
        with pytest.raises(grpc.RpcError) as err:
            stub.ForwardBackward(fb_request(run.model_id, never_sent, FIRST))  # too late: order already given up
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stopped waiting" in err.value.details()
        assert request_rows(postgres_url, run.model_id) == [(2, "forward_backward", "done")]
        client.close()


def test_completed_requests_are_answered_again_after_a_restart_within_the_result_window(tiny_model_dir, postgres_url,
                                                                                         tmp_path):
    with start_stack(tiny_model_dir, postgres_url, tmp_path / "stack", TEMPER_SCHEDULER_DURABLE_RESULTS_PER_RUN="2") as local:
        client = local.client()
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=6)
        stub = raw_stub(local)
        requests = {
            "ForwardBackward": fb_request(run.model_id, 1, FIRST),
            "OptimStep": service_pb2.OptimStepRequest(training_run_id=run.model_id, seq_id=2, adam_params=convert.adam_to_proto(ADAM)),
            "SaveWeights": service_pb2.SaveWeightsRequest(training_run_id=run.model_id, seq_id=3, name="kept", kind=1),
        }
        answers = {verb: getattr(stub, verb)(request) for verb, request in requests.items()}
        local.restart_scheduler(crash=True)

        stub = raw_stub(local)
        # seq 1 fell out of the 2-request window: its answer is gone, and it is not run again
        with pytest.raises(grpc.RpcError) as err:
            stub.ForwardBackward(requests["ForwardBackward"])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no longer held" in err.value.details()
        for verb in ("OptimStep", "SaveWeights"):
            assert getattr(stub, verb)(requests[verb]) == answers[verb], verb
        assert request_rows(postgres_url, run.model_id) == [
            (1, "forward_backward", "done"), (2, "optim_step", "done"), (3, "save_weights", "done")]
        engine = create_engine(postgres_url)
        with engine.connect() as conn:  # counted once: nothing ran a second time
            steps, tokens = conn.execute(text("select steps, tokens_trained from training_runs where id = :r"),
                                         {"r": run.model_id}).one()
        engine.dispose()
        assert (steps, tokens) == (1, len(FIRST) - 1)
        client.close()
