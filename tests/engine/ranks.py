"""Spawned rank processes for the multi-process engine tests (test_sharded, test_trainer_group,
test_deterministic_wire, test_plan_measured's world-size-2 child): a free port to rendezvous on, and
the ranks started, their results collected from a queue and the processes reaped."""

from __future__ import annotations

import socket
import time
from typing import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable, args_of: Callable[[int, object], tuple], world: int = 2, timeout: float = 180.0) -> dict:
    """Start ``world`` spawned processes ``target(*args_of(rank, queue))``; each puts ``(rank, result)``
    (or an exception, raised here) on the queue. Their results by rank, once every one exited 0."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_of(rank, out)) for rank in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world:
            rank, got = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if isinstance(got, Exception):
                raise got
            results[rank] = got
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
    return results
