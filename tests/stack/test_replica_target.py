"""Several replicas behind one name (issue 32, part 3): temper.client's runtime and the gateway's
upstream reach two real gRPC servers of the Temper service through one address list
(common/channel_target.py: ipv4:...,... with round_robin). Calls spread over both; when one replica
is SIGKILLed, with calls in flight, every call still succeeds through the other (round_robin skips the
dead subchannel; a call caught on it fails UNAVAILABLE and the caller's retry resends it). The
replicas are tests/stack/replica_stub.py processes (two real schedulers on one database are not
supported yet). ~5 s."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from temper.client.runtime import open_runtime
from temper.services.gateway.upstream import Scheduler
from temper.v1 import service_pb2

STUB = Path(__file__).with_name("replica_stub.py")
REQUEST = service_pb2.GetServerCapabilitiesRequest()


@pytest.fixture
def replicas():
    """{name: (process, port)} of two running replicas, "a" and "b"."""
    started = {}
    try:
        for name in ("a", "b"):
            proc = subprocess.Popen([sys.executable, str(STUB), name], stdout=subprocess.PIPE, text=True)
            started[name] = (proc, int(proc.stdout.readline()))
        yield started
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def address(replicas) -> str:
    return ",".join(f"127.0.0.1:{port}" for _, port in replicas.values())


def kill(replicas, name: str) -> None:
    proc = replicas[name][0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def answered_by(response) -> str:
    return response.supported_models[0].model_name


def test_client_runtime_spreads_over_replicas_and_survives_one_killed(replicas):
    runtime = open_runtime(address(replicas), None, timeout=10, connect_timeout=10)
    try:
        spread = Counter(answered_by(runtime.rpc("GetServerCapabilities", REQUEST).result(timeout=10)) for _ in range(40))
        assert set(spread) == {"a", "b"} and min(spread.values()) >= 10, spread

        # Calls keep going from four threads while "a" is killed under them: none may fail.
        answers, errors, stop = Counter(), [], threading.Event()

        def caller():
            while not stop.is_set():
                try:
                    answers[answered_by(runtime.rpc("GetServerCapabilities", REQUEST).result(timeout=10))] += 1
                except Exception as exc:  # noqa: BLE001 (recorded: the assertion below names it)
                    errors.append(exc)

        threads = [threading.Thread(target=caller) for _ in range(4)]
        for thread in threads:
            thread.start()
        threading.Event().wait(0.5)
        kill(replicas, "a")
        threading.Event().wait(1.0)
        stop.set()
        for thread in threads:
            thread.join(timeout=15)
        assert errors == [], errors[:3]
        assert answers["a"] > 0 and answers["b"] > 0, answers

        after = Counter(answered_by(runtime.rpc("GetServerCapabilities", REQUEST).result(timeout=10)) for _ in range(20))
        assert after == {"b": 20}
    finally:
        runtime.close()


def test_gateway_upstream_spreads_over_replicas_and_survives_one_killed(replicas):
    async def scenario():
        upstream = Scheduler(address(replicas), timeout=10, unavailable_seconds=10)
        try:
            # Gateway verbs are not wait_for_ready: resent on UNAVAILABLE, which covers the connecting
            # start and the killed replica alike.
            spread = Counter([answered_by(await upstream.verb("GetServerCapabilities", REQUEST, None)) for _ in range(40)])
            assert set(spread) == {"a", "b"} and min(spread.values()) >= 10, spread

            async def calls(n):
                return [answered_by(await upstream.verb("GetServerCapabilities", REQUEST, None)) for _ in range(n)]

            in_flight = [asyncio.ensure_future(calls(60)) for _ in range(4)]
            await asyncio.sleep(0.2)
            await asyncio.to_thread(kill, replicas, "a")
            answered = Counter(name for batch in await asyncio.gather(*in_flight) for name in batch)
            assert sum(answered.values()) == 240 and answered["b"] > 0, answered

            assert Counter(await calls(20)) == {"b": 20}
        finally:
            await upstream.close()

    asyncio.run(scenario())
