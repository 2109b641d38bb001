"""Faults around the scheduler on the real stack and Postgres, and what clients are told about them:
the database refusing connections for a few seconds mid-stream, a scheduler restarted while its
trainer does not answer yet, and a scheduler whose loop dies. A request is answered failed only if
it was not and will not be applied; otherwise it succeeds (perhaps through the client's retry of an
UNAVAILABLE answer), and every run's weights equal a twin's that replays exactly the requests
answered successfully."""

from __future__ import annotations

import select
import socket
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from fixtures_stack import adapter_weights, assert_same_weights, keyed_channel, request_rows, sft_datum
from temper.client import AdamParams, ServiceClient, convert
from temper.common.errors import TemperError, Unavailable
from temper.localstack import LocalStack
from temper.v1 import service_pb2, service_pb2_grpc

ADAM = AdamParams(learning_rate=5e-3, eps=1e-8)
ROUNDS = [[7, 19, 42, 101, 250, 33, 77, 5], [3, 9, 27, 81, 243, 217, 139], [11, 22, 33, 44, 55, 66, 77, 88, 99],
          [300, 200, 100, 50, 25, 12], [5, 10, 15, 20, 25, 30, 35, 40], [64, 128, 256, 32, 16, 8, 4]]
SAMPLER = 1  # CHECKPOINT_KIND_SAMPLER


# ---- helpers ---------------------------------------------------------------------------------


class FlakyProxy:
    """A loopback TCP proxy to one upstream server that can go down (every open connection closed,
    new ones refused: the listening socket is closed) and come back up on the same port. One thread
    owns the listener; each connection has a pump thread per direction. Stops itself after
    ``lifetime`` seconds in any case."""

    def __init__(self, upstream: tuple[str, int], lifetime: float = 600.0):
        self.upstream = upstream
        self.deadline = time.monotonic() + lifetime
        self.port = 0
        self.connections = 0
        self._want_up = True
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._trap: float | None = None
        self._mute = False  # drop what servers send (set when the trap fires, cleared by up())
        self._thread = threading.Thread(target=self._serve, name="flaky-proxy", daemon=True)
        self._thread.start()
        self._wait_for(lambda: self._listener is not None)

    def url(self, database_url: str) -> str:
        return make_url(database_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def down(self) -> None:
        with self._lock:
            self._want_up = False
        self._wait_for(lambda: self._listener is None)

    def up(self) -> None:
        with self._lock:
            self._want_up, self._mute = True, False
        self._wait_for(lambda: self._listener is not None)

    def cut_after_next_commit(self, hold: float = 0.3) -> None:
        """Arm a trap: the next COMMIT a client sends reaches the server, but from then on nothing the
        server says reaches any client, and ``hold`` seconds later the proxy goes down (a commit that
        happened and whose acknowledgement was lost)."""
        self._trap = hold

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _wait_for(self, condition) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: condition() or self._stop.is_set(), timeout=10), "proxy did not switch"

    def _serve(self) -> None:
        try:
            while not self._stop.is_set() and time.monotonic() < self.deadline:
                self._switch()
                listener = self._listener
                if listener is None or not select.select([listener], [], [], 0.05)[0]:
                    time.sleep(0.0 if listener else 0.05)
                    continue
                client, _ = listener.accept()
                try:
                    server = socket.create_connection(self.upstream, timeout=5)
                except OSError:
                    client.close()
                    continue
                for sock in (client, server):
                    sock.settimeout(None)
                with self._lock:
                    self._sockets |= {client, server}
                    self.connections += 1
                for a, b, upstream in ((client, server, True), (server, client, False)):
                    threading.Thread(target=self._pump, args=(a, b, upstream), daemon=True).start()
        finally:
            with self._changed:
                self._want_up = False
            self._switch()
            self._stop.set()
            with self._changed:
                self._changed.notify_all()

    def _switch(self) -> None:
        with self._changed:
            if self._want_up and self._listener is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", self.port))
                listener.listen(64)
                self._listener, self.port = listener, listener.getsockname()[1]
                self._changed.notify_all()
            elif not self._want_up and self._listener is not None:
                self._listener.close()
                self._listener = None
                for sock in self._sockets:
                    _close(sock)
                self._sockets.clear()
                self._changed.notify_all()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                if not upstream and self._mute:
                    continue
                sink.sendall(data)
                if upstream and self._trap is not None and b"COMMIT" in data:
                    hold, self._trap, self._mute = self._trap, None, True
                    timer = threading.Timer(hold, self.down)
                    timer.daemon = True
                    timer.start()
        except OSError:
            pass
        with self._lock:
            self._sockets -= {source, sink}
        _close(source)
        _close(sink)

    def __enter__(self) -> "FlakyProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv on it
    except OSError:
        pass
    sock.close()


def tcp_upstream(database_url: str) -> tuple[str, int]:
    url = make_url(database_url)
    assert url.host and not url.host.startswith("/"), f"the proxy needs Postgres over TCP, got {url.render_as_string()}"
    return url.host, url.port or 5432


def start_stack(tiny_model_dir, database_url, folder, **env) -> LocalStack:
    local = LocalStack(tiny_model_dir, folder, database_url=database_url, num_threads=1, extra_env=env)
    local.address = local.start()
    return local


def fb_request(run_id: str, seq: int, tokens: list[int]) -> service_pb2.ForwardBackwardRequest:
    return service_pb2.ForwardBackwardRequest(training_run_id=run_id, seq_id=seq, data=[convert.datum_to_proto(sft_datum(tokens))],
                                              loss_fn="cross_entropy")


def optim_request(run_id: str, seq: int) -> service_pb2.OptimStepRequest:
    return service_pb2.OptimStepRequest(training_run_id=run_id, seq_id=seq, adam_params=convert.adam_to_proto(ADAM))


def save_request(run_id: str, seq: int, name: str) -> service_pb2.SaveWeightsRequest:
    return service_pb2.SaveWeightsRequest(training_run_id=run_id, seq_id=seq, name=name, kind=SAMPLER)


def replayed(request, run_id: str, seq: int):
    copy = type(request)()
    copy.CopyFrom(request)
    copy.training_run_id, copy.seq_id = run_id, seq
    return copy


def unfinished_rows(url: str, run_ids: list[str]) -> list[tuple]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("select training_run_id, seq_id, kind, status from requests "
                                 "where training_run_id = any(:runs) and status in ('queued', 'running')"), {"runs": run_ids}).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def run_counters(url: str, run_id: str) -> tuple[int, int]:
    engine = create_engine(url)
    with engine.connect() as conn:
        row = conn.execute(text("select tokens_trained, steps from training_runs where id = :r"), {"r": run_id}).one()
    engine.dispose()
    return tuple(row)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_close_weights(a, b) -> None:
    """For runs whose passes were batched differently from their twin's (other tenants in the cycle)."""
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-6, rtol=0, err_msg=key)


def metric(service, series: str) -> float:
    """One sample from a service's /metrics; ``series`` as written there, labels included."""
    with urllib.request.urlopen(service.metrics_url, timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in {service.metrics_url}")


def log_count(service, needle: str) -> int:
    return service.log_path.read_text(errors="replace").count(needle)


# ---- the store alone ---------------------------------------------------------------------------


def test_a_store_whose_connections_are_cut_answers_unavailable_and_reconnects(new_postgres_database):
    from temper.scheduler.db.store import Store, upgrade_schema

    url = new_postgres_database("temper_faults")
    upgrade_schema(url)
    with FlakyProxy(tcp_upstream(url)) as proxy:
        store = Store(proxy.url(url))
        assert store.get_request("no-such-run", 1) is None
        proxy.down()  # the pooled connection is cut, new ones are refused
        with pytest.raises(Unavailable):
            store.get_request("no-such-run", 1)
        with pytest.raises(Unavailable):
            store.tenant_weights()
        proxy.up()
        assert store.get_request("no-such-run", 1) is None  # the pool reconnects by itself
        store.engine.dispose()


def test_finishing_requests_again_counts_nothing_twice(new_postgres_database):
    """What the loop does when a finish_requests call failed after its commit: it sends it again."""
    from fixtures_stack import store_with_run

    url = new_postgres_database("temper_faults")
    store, run_id = store_with_run(url)
    store.add_request(run_id, 1, "forward_backward", "sha1", "queued", 6)
    store.add_request(run_id, 2, "optim_step", "sha2", "queued", 0)
    store.mark_running([(run_id, 1), (run_id, 2)])
    outcomes = [(run_id, 1, "done", None, b"fb"), (run_id, 2, "done", None, b"step")]
    for _ in range(2):
        store.finish_requests(outcomes, {run_id: 6}, {run_id: 1}, {run_id: 3}, result_window=256)
    assert run_counters(url, run_id) == (6, 1)
    assert store.get_request(run_id, 2).result == b"step"
    store.engine.dispose()


# ---- 1. the database goes away for a few seconds ------------------------------------------------


def test_a_database_outage_mid_stream_loses_nothing_and_applies_nothing_twice(tiny_model_dir, new_postgres_database, tmp_path):
    real_url = new_postgres_database("temper_faults")
    with FlakyProxy(tcp_upstream(real_url)) as proxy, \
            start_stack(tiny_model_dir, proxy.url(real_url), tmp_path / "stack") as local:
        tenants = ("a", "b")
        clients = {t: local.client(t) for t in tenants}
        runs = {t: clients[t].create_lora_training_client(tiny_model_dir, rank=4, seed=20 + i).model_id
                for i, t in enumerate(tenants)}
        sent: dict[str, list] = {t: [] for t in tenants}          # request protos in seq order
        futures: dict[tuple[str, int], object] = {}
        finished_at: dict[tuple[str, int], float] = {}

        def submit(round_index: int) -> None:
            for t in tenants:
                for request in (fb_request(runs[t], 2 * round_index + 1, ROUNDS[round_index]),
                                optim_request(runs[t], 2 * round_index + 2)):
                    verb = "ForwardBackward" if isinstance(request, service_pb2.ForwardBackwardRequest) else "OptimStep"
                    key = (t, request.seq_id)
                    sent[t].append((verb, request))
                    futures[key] = clients[t].runtime.rpc(verb, request)
                    futures[key].add_done_callback(lambda _f, key=key: finished_at.setdefault(key, time.monotonic()))

        submit(0)
        for future in futures.values():
            future.result(timeout=60)
        # Round 1 is on the trainer (held there by freezing it) when the database goes away, so the
        # loop has to record its outcome after the outage; rounds 2 and 3 arrive during it.
        local.pause("trainer")
        try:
            submit(1)
            wait_until(lambda: any(status == "running" for r in runs.values() for _, _, status in request_rows(real_url, r)), 30,
                       "round 1 on the trainer")
            proxy.down()
            went_down = time.monotonic()
        finally:
            local.resume("trainer")
        submit(2)          # arrives while the database refuses connections
        time.sleep(1.0)
        submit(3)
        time.sleep(max(0.0, went_down + 3.0 - time.monotonic()))
        proxy.up()
        came_up = time.monotonic()
        submit(4)          # beside the retries of rounds 2 and 3
        submit(5)

        # Final outcomes; an UNAVAILABLE answer is resent (as the contract says) to learn the truth.
        outcomes: dict[tuple[str, int], object] = {}
        for t in tenants:
            for verb, request in sent[t]:
                key = (t, request.seq_id)
                try:
                    outcomes[key] = futures[key].result(timeout=120)
                except Unavailable:
                    retry = clients[t].runtime.rpc(verb, request)
                    try:
                        outcomes[key] = retry.result(timeout=120)
                    except TemperError as exc:
                        outcomes[key] = exc
                except TemperError as exc:
                    outcomes[key] = exc
        failures = {k: (v.code.name, v.message) for k, v in outcomes.items() if isinstance(v, TemperError)}
        lies = {k: v for k, v in failures.items() if v[0] not in ("FAILED_PRECONDITION", "INVALID_ARGUMENT", "ALREADY_EXISTS")}
        assert not lies, f"answers that do not say whether the request was applied: {lies}"
        # The requests sent during the outage could only be admitted once the database was back.
        during = [(t, s) for t in tenants for s in (5, 6, 7, 8)]
        assert all(finished_at[k] >= came_up for k in during), {k: finished_at[k] - came_up for k in during}

        # Twins after the outage: fresh runs, same seeds, replaying exactly what was answered successfully.
        twins = {t: clients[t].create_lora_training_client(tiny_model_dir, rank=4, seed=20 + i).model_id
                 for i, t in enumerate(tenants)}
        twin_answers = {}
        replayed_count = {}
        for t in tenants:
            applied = [(verb, request) for verb, request in sent[t] if not isinstance(outcomes[(t, request.seq_id)], TemperError)]
            for n, (verb, request) in enumerate(applied, start=1):
                twin_answers[(t, request.seq_id)] = clients[t].runtime.rpc(verb, replayed(request, twins[t], n)).result(timeout=60)
            replayed_count[t] = len(applied)
        for key, answer in outcomes.items():
            if isinstance(answer, service_pb2.OptimStepResponse):
                assert answer.metrics["num_tokens:sum"] == twin_answers[key].metrics["num_tokens:sum"], key
            elif not isinstance(answer, TemperError):
                assert answer.metrics["loss:sum"] == pytest.approx(twin_answers[key].metrics["loss:sum"], abs=1e-4), key

        for t in tenants:
            paths = [clients[t].runtime.rpc("SaveWeights", save_request(runs[t], len(sent[t]) + 1, "after")).result(timeout=60),
                     clients[t].runtime.rpc("SaveWeights", save_request(twins[t], replayed_count[t] + 1, "after")).result(timeout=60)]
            got, want = (adapter_weights(clients[t], p.checkpoint.path, tmp_path / t) for p in paths)
            assert_close_weights(got, want)

            # Counted once: the run's counters are what its successful requests add up to.
            ok = [r for _, r in sent[t] if not isinstance(outcomes[(t, r.seq_id)], TemperError)]
            tokens = sum(len(ROUNDS[(r.seq_id - 1) // 2]) - 1 for r in ok if isinstance(r, service_pb2.ForwardBackwardRequest))
            steps = sum(isinstance(r, service_pb2.OptimStepRequest) for r in ok)
            usage = clients[t].get_usage()["runs"]
            assert usage[runs[t]] == {"tokens_trained": tokens, "steps": steps}
            assert usage[twins[t]] == usage[runs[t]]

        assert unfinished_rows(real_url, [*runs.values(), *twins.values()]) == []
        # Applied once on the trainer too: each token of a run and of its twin went through one backward pass.
        usage = {t: clients[t].get_usage()["runs"] for t in tenants}
        trained = sum(usage[t][r]["tokens_trained"] for t in tenants for r in (runs[t], twins[t]))
        assert metric(local.service("trainer"), "temper_trainer_tokens_trained_total") == trained
        scheduler = local.service("scheduler")
        assert log_count(scheduler, "retrying finish_requests") >= 1  # the loop waited for the database
        print(f"\noutage 3 s: {len(outcomes)} requests, {len(failures)} failed {failures}; "
              f"{log_count(scheduler, 'the database is unavailable')} database-unavailable log lines, "
              f"{log_count(scheduler, 'retrying finish_requests')} finish_requests retries; "
              f"proxy connections {proxy.connections}; rounds 2-3 answered "
              f"{max(finished_at[k] for k in during) - came_up:.2f} s after the database came back")
        assert not failures, failures  # the client's retries outlast a 3 s outage
        for client in clients.values():
            client.close()


def test_a_recorded_outcome_whose_commit_acknowledgement_was_lost_is_counted_once(tiny_model_dir, new_postgres_database,
                                                                                   tmp_path):
    """The loop resends its finish_requests write after a database error; if the first attempt had in
    fact committed, the resend must not add the run's tokens and steps a second time."""
    real_url = new_postgres_database("temper_faults")
    with FlakyProxy(tcp_upstream(real_url)) as proxy, \
            start_stack(tiny_model_dir, proxy.url(real_url), tmp_path / "stack") as local:
        client = local.client()
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=51)
        run.forward_backward([sft_datum(ROUNDS[0])]).result(timeout=60)
        run.optim_step(ADAM).result(timeout=60)
        local.pause("trainer")
        try:
            third, step = run.forward_backward([sft_datum(ROUNDS[1])]), run.optim_step(ADAM)
            wait_until(lambda: request_rows(real_url, run.model_id)[2:] in ([(3, "forward_backward", "running"), (4, "optim_step", s)]
                                                                             for s in ("queued", "running")), 30, "seq 3 on the trainer")
            proxy.cut_after_next_commit()  # the next commit is seq 3's outcome (nothing else is writing)
        finally:
            local.resume("trainer")
        wait_until(lambda: log_count(local.service("scheduler"), "retrying finish_requests") >= 1, 30, "the loop to retry")
        assert request_rows(real_url, run.model_id)[2] == (3, "forward_backward", "done")  # the first attempt committed
        proxy.up()
        third.result(timeout=60)
        assert step.result(timeout=60).metrics["num_tokens:sum"] == len(ROUNDS[1]) - 1
        assert run_counters(real_url, run.model_id) == (len(ROUNDS[0]) - 1 + len(ROUNDS[1]) - 1, 2)
        assert client.get_usage()["runs"][run.model_id] == {"tokens_trained": len(ROUNDS[0]) + len(ROUNDS[1]) - 2, "steps": 2}
        client.close()


# ---- 2. the scheduler restarts while its trainer is frozen --------------------------------------


def test_a_scheduler_restarted_while_its_trainer_is_frozen_answers_the_resent_work_once(tiny_model_dir, new_postgres_database,
                                                                                        tmp_path):
    url = new_postgres_database("temper_faults")
    with start_stack(tiny_model_dir, url, tmp_path / "stack") as local:
        client = local.client()
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=31)
        twin = client.create_lora_training_client(tiny_model_dir, rank=4, seed=31)
        run.forward_backward([sft_datum(ROUNDS[0])]).result(timeout=60)
        run.optim_step(ADAM).result(timeout=60)

        # seq 3 is big enough (4 micro-batch passes, ~2 s here) to freeze the trainer in the middle of it:
        # the killed scheduler's cycle is applied once the trainer resumes, and its answer has nobody to go to.
        big = [sft_datum([(i * 7 + j) % 500 for i in range(2000)]) for j in range(8)]
        trainer, passes = local.service("trainer"), 'temper_trainer_pass_seconds_count{kind="forward_backward"}'
        passes_before = metric(trainer, passes)
        pending = run.forward_backward(big)
        wait_until(lambda: metric(trainer, passes) > passes_before, 60, "seq 3's first pass on the trainer")
        local.pause("trainer")
        try:
            assert (3, "forward_backward", "running") in request_rows(url, run.model_id), "seq 3 finished before the freeze"
            started = time.monotonic()
            local.restart_scheduler(crash=True)  # must come up (and say so) without its trainer
            restarted_in = time.monotonic() - started
            time.sleep(3.0)
            assert not pending.done()  # the client is still resending seq 3 to the new process
        finally:
            local.resume("trainer")
        third = pending.result(timeout=120)
        step = run.optim_step(ADAM).result(timeout=60)

        twin.forward_backward([sft_datum(ROUNDS[0])]).result(timeout=60)
        twin.optim_step(ADAM).result(timeout=60)
        twin_third = twin.forward_backward(big).result(timeout=60)
        twin_step = twin.optim_step(ADAM).result(timeout=60)
        assert third.metrics["loss:sum"] == pytest.approx(twin_third.metrics["loss:sum"], rel=1e-6)
        assert step.metrics["num_tokens:sum"] == 8 * 1999  # seq 3's tokens, counted once
        assert step.metrics == pytest.approx(twin_step.metrics, abs=1e-5)
        paths = [r.save_weights_for_sampler("after").result(timeout=60).path for r in (run, twin)]
        assert_same_weights(*(adapter_weights(client, p, tmp_path) for p in paths))  # same cycles as the twin's
        assert request_rows(url, run.model_id) == [(1, "forward_backward", "done"), (2, "optim_step", "done"),
                                                   (3, "forward_backward", "done"), (4, "optim_step", "done"),
                                                   (5, "save_weights", "done")]
        assert run_counters(url, run.model_id) == (len(ROUNDS[0]) - 1 + 8 * 1999, 2)
        assert unfinished_rows(url, [run.model_id, twin.model_id]) == []
        assert metric(trainer, "temper_trainer_tokens_trained_total") == 2 * run_counters(url, run.model_id)[0]
        # 4 cycles each for the run and its twin, plus the killed scheduler's, which did run on the trainer
        # (the resend was answered from the trainer's memory: its tokens are counted once above).
        assert metric(trainer, "temper_trainer_cycles_total") == 9
        print(f"\nscheduler restarted (ready line) in {restarted_in:.1f} s with its trainer frozen")
        client.close()


# ---- 3. the scheduler's loop dies ----------------------------------------------------------------

FAULTY_SCHEDULER = """
import pathlib, temper.scheduler.planning.lanes as lanes
marker, plan_cycle = pathlib.Path({marker!r}), lanes.plan_cycle
def failing_plan_cycle(*args, **kwargs):
    if marker.exists():
        raise RuntimeError("injected: plan_cycle failed")
    return plan_cycle(*args, **kwargs)
lanes.plan_cycle = failing_plan_cycle
from temper.scheduler.__main__ import main
main()
"""


def test_a_dead_loop_fails_waiting_requests_unavailable_and_exits_and_a_restart_serves_them(tiny_model_dir, new_postgres_database,
                                                                                           tmp_path):
    url = new_postgres_database("temper_faults")
    marker = tmp_path / "fail-plan-cycle"
    with start_stack(tiny_model_dir, url, tmp_path / "stack") as local:
        client = local.client()
        run = client.create_lora_training_client(tiny_model_dir, rank=4, seed=41)
        twin = client.create_lora_training_client(tiny_model_dir, rank=4, seed=41)
        run.forward_backward([sft_datum(ROUNDS[0])]).result(timeout=60)
        run.optim_step(ADAM).result(timeout=60)

        faulty = local.restart("scheduler", argv=[sys.executable, "-c", FAULTY_SCHEDULER.format(marker=str(marker))], timeout=120)
        channel = keyed_channel(local)
        stub = service_pb2_grpc.TemperStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        wait_until(lambda: health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING, 60,
                   "the scheduler to serve")
        seen: list = []
        watch = health.Watch(health_pb2.HealthCheckRequest())

        def follow() -> None:
            try:
                for answer in watch:
                    seen.append(answer.status)
            except grpc.RpcError as err:
                seen.append(err.code())

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()

        # seq 4 waits in the queue behind seq 3; then the loop dies when seq 3 arrives.
        requests = {3: fb_request(run.model_id, 3, ROUNDS[1]), 4: fb_request(run.model_id, 4, ROUNDS[2])}
        parked = stub.ForwardBackward.future(requests[4])
        wait_until(lambda: (4, "forward_backward", "queued") in request_rows(url, run.model_id), 30, "seq 4 queued")
        marker.touch()
        head = stub.ForwardBackward.future(requests[3])
        for future in (head, parked):
            with pytest.raises(grpc.RpcError) as err:
                future.result(timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert faulty.process.wait(timeout=60) == 3  # EXIT_LOOP_FAILED
        watcher.join(timeout=30)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen
        assert log_count(faulty, "injected: plan_cycle failed") >= 1
        channel.close()

        local.restart("scheduler", timeout=120)  # a normal one, same port and database
        retry = client.runtime.rpc  # the client's resends (UNAVAILABLE and RESOURCE_EXHAUSTED retried)
        third, fourth = (retry("ForwardBackward", requests[s]).result(timeout=120) for s in (3, 4))
        step = retry("OptimStep", optim_request(run.model_id, 5)).result(timeout=60)

        for tokens in ROUNDS[:1]:
            twin.forward_backward([sft_datum(tokens)]).result(timeout=60)
        twin.optim_step(ADAM).result(timeout=60)
        twin_third = twin.forward_backward([sft_datum(ROUNDS[1])]).result(timeout=60)
        twin_fourth = twin.forward_backward([sft_datum(ROUNDS[2])]).result(timeout=60)
        twin_step = twin.optim_step(ADAM).result(timeout=60)
        assert third.metrics["loss:sum"] == pytest.approx(twin_third.metrics["loss:sum"], abs=1e-5)
        assert fourth.metrics["loss:sum"] == pytest.approx(twin_fourth.metrics["loss:sum"], abs=1e-5)
        assert step.metrics["num_tokens:sum"] == twin_step.metrics["num_tokens:sum"] == len(ROUNDS[1]) + len(ROUNDS[2]) - 2
        saved = retry("SaveWeights", save_request(run.model_id, 6, "after")).result(timeout=60)
        assert_same_weights(adapter_weights(client, saved.checkpoint.path, tmp_path),
                             adapter_weights(client, twin.save_weights_for_sampler("after").result(timeout=60).path, tmp_path))
        assert request_rows(url, run.model_id) == [(1, "forward_backward", "done"), (2, "optim_step", "done"),
                                                   (3, "forward_backward", "done"), (4, "forward_backward", "done"),
                                                   (5, "optim_step", "done"), (6, "save_weights", "done")]
        assert run_counters(url, run.model_id) == (sum(len(r) - 1 for r in ROUNDS[:3]), 2)
        assert unfinished_rows(url, [run.model_id, twin.model_id]) == []
        assert metric(local.service("trainer"), "temper_trainer_tokens_trained_total") == 2 * run_counters(url, run.model_id)[0]
        client.close()
