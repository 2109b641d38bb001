"""A seq its client gave up on never stalls its run (issue 21, edge 3): the client abandons it
(AbandonSeq), the scheduler skips it durably unless it was recorded, and the run's next request
goes on at once. The gap timeout is 300 s in every test; each test's own timeout is a few seconds."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fakes_scheduler import build, fb
from temper.client.runtime import Runtime
from temper.common.errors import ErrorInterceptor, FailedPrecondition, Unavailable
from temper.services.gateway.abandon import abandon_unless_settled
from temper.services.gateway.errors import GatewayError
from temper.v1 import service_pb2, service_pb2_grpc
from test_admission import servicer_of, started

GAP = 300.0  # the default seq_gap_timeout_seconds: a test that waited for it would time out


def abandon(api, run: str, seq: int):
    return api.AbandonSeq(service_pb2.AbandonSeqRequest(training_run_id=run, seq_id=seq), None)


@pytest.mark.timeout(20)
def test_a_seq_given_up_in_a_database_outage_is_abandoned_and_the_runs_next_call_goes_on_at_once():
    async def main():
        async with started(seq_gap_timeout_seconds=GAP, runs={"r": "alice"}) as (s, api):
            server = grpc.aio.server(interceptors=[ErrorInterceptor()])
            service_pb2_grpc.add_TemperServicer_to_server(api, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            client = await asyncio.to_thread(Runtime, f"127.0.0.1:{port}", [], max_retries=1, connect_timeout=5)

            def send(seq: int):
                return asyncio.wrap_future(client.call_soon(client.sequenced("ForwardBackward", fb("r", seq))))

            try:
                assert (await send(1)).metrics["loss:sum"] == 1.0
                s.store.down = True  # outlasts the client's retries of seq 2
                with pytest.raises(Unavailable):
                    await send(2)
                s.store.down = False  # the client's abandonment of seq 2 now gets through, in the background
                assert (await send(3)).metrics["loss:sum"] == 3.0  # not parked behind seq 2 for GAP seconds
                with pytest.raises(FailedPrecondition, match="skipped"):
                    await send(2)  # definitely skipped: never applied after seq 3
                assert s.trainer.applied == [("r", 1), ("r", 3)] and s.store.statuses("r") == {1: "done", 2: "skipped", 3: "done"}
            finally:
                await asyncio.to_thread(client.close)
                await server.stop(None)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_abandoning_a_recorded_seq_keeps_it_in_place_and_an_unrecorded_one_is_skipped():
    async def main():
        async with started(seq_gap_timeout_seconds=GAP, runs={"r": "alice"}) as (s, api):
            parked = asyncio.create_task(api.ForwardBackward(fb("r", 2), None))  # recorded, waits for seq 1
            await asyncio.sleep(0.05)
            assert (await abandon(api, "r", 2)).skipped is False  # recorded: it keeps its place
            assert (await abandon(api, "r", 1)).skipped is True   # never recorded: skipped, seq 2 goes on
            assert (await parked).metrics["loss:sum"] == 2.0
            assert (await abandon(api, "r", 1)).skipped is True and (await abandon(api, "r", 2)).skipped is False  # idempotent
            s.store.down = True
            with pytest.raises(Unavailable):
                await abandon(api, "r", 3)  # nothing recorded, nothing skipped: the client resends it
            s.store.down = False
            assert 3 not in s.store.statuses("r") and not s.admission.queues["r"].was_skipped(3)

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_skip_outlives_a_scheduler_restart():
    async def main():
        async with started(seq_gap_timeout_seconds=GAP, runs={"r": "alice"}) as (s, api):
            await api.ForwardBackward(fb("r", 1), None)
            assert (await abandon(api, "r", 2)).skipped is True
        s.store.runs["r"].next_seq_id = 2  # as the loop's finish_requests left it
        restarted = build(store=s.store, seq_gap_timeout_seconds=GAP)
        task = asyncio.create_task(restarted.loop.run_forever())
        try:
            api = servicer_of(restarted)
            assert (await api.ForwardBackward(fb("r", 3), None)).metrics["loss:sum"] == 3.0
            with pytest.raises(FailedPrecondition, match="skipped"):
                await api.ForwardBackward(fb("r", 2), None)
        finally:
            task.cancel()

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_the_gateway_abandons_a_seq_it_gave_up_on_for_an_sdk_caller_until_the_scheduler_answers():
    class Scheduler:
        def __init__(self):
            self.abandoned, self.failures = [], 1

        async def verb(self, method, request, key):
            if self.failures:  # the outage outlasts the first resend too
                self.failures -= 1
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "database down")
            self.abandoned.append((method, request.training_run_id, request.seq_id, key))
            return service_pb2.AbandonSeqResponse(skipped=True)

    async def main():
        scheduler = Scheduler()
        abandon_unless_settled(scheduler, "k", "r", 4, GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))  # settled: spent
        abandon_unless_settled(scheduler, "k", "r", 5, GatewayError(grpc.StatusCode.UNAVAILABLE, "gave up"))
        while not scheduler.abandoned:
            await asyncio.sleep(0.05)
        assert scheduler.abandoned == [("AbandonSeq", "r", 5, "k")]

    asyncio.run(main())


def test_the_store_skips_only_a_seq_without_a_row_or_one_left_queued(tmp_path):
    from test_tenancy_store_sqlite import run_of

    from temper.scheduler.db.store import Store, upgrade_schema

    url = f"sqlite:///{tmp_path / 'temper.db'}"
    upgrade_schema(url)
    store = Store(url)
    run = run_of(store, "alice")
    store.add_request(run, 2, "forward_backward", "sha", "queued", 3)
    store.add_request(run, 3, "forward_backward", "sha", "running", 3)
    assert store.skip_request(run, 1, queued_too=False) == "skipped"   # no row: a skipped one
    assert store.skip_request(run, 2, queued_too=False) == "queued"    # may be in a cycle already: left alone
    assert store.skip_request(run, 2, queued_too=True) == "skipped"    # never left the scheduler
    assert store.skip_request(run, 3, queued_too=True) == "running"    # may have been applied: left alone
    assert store.skip_request(run, 1, queued_too=True) == "skipped"    # idempotent
    assert store.skipped_seqs(run, 1) == (1, 2) and store.skipped_seqs(run, 2) == (2,)
    assert store.get_request(run, 2).payload_sha256 == "" and store.get_request(run, 3).status == "running"


@pytest.mark.timeout(10)
def test_an_sdk_verb_the_gateway_gives_up_on_is_abandoned_at_the_scheduler():
    from fastapi.testclient import TestClient

    from temper.services.gateway.app import create_app

    class Scheduler:
        def __init__(self):
            self.sent = []

        async def verb(self, method, request, key):
            self.sent.append((method, request.seq_id))
            if method != "AbandonSeq":  # the gateway's resends of it ran out in an outage
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the database is unavailable")
            return service_pb2.AbandonSeqResponse(skipped=True)

        async def close(self):
            pass

    scheduler, headers = Scheduler(), {"X-API-Key": "tml-k"}
    body = {"model_id": "s:train:0", "seq_id": 7, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [
        {"model_input": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
         "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64"}}}]}}
    with TestClient(create_app(scheduler, long_poll_seconds=0.05)) as http:
        future = http.post("/api/v1/forward_backward", json=body, headers=headers).json()
        while (result := http.post("/api/v1/retrieve_future", json=future, headers=headers).json()).get("type") == "try_again":
            pass
        assert "UNAVAILABLE" in str(result)  # the SDK hears the failure
        while ("AbandonSeq", 7) not in scheduler.sent:
            http.post("/api/v1/retrieve_future", json=future, headers=headers)  # lets the gateway's loop run
        assert scheduler.sent == [("ForwardBackward", 7), ("AbandonSeq", 7)]
