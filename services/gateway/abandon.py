"""The seqs the gateway gives up on for its SDK callers (the SDK numbers them; the gateway resends
each for ``unavailable_seconds``): abandoned at the scheduler in the background, resent until it
answers, so the run's next request does not wait the scheduler's seq-gap timeout."""

from __future__ import annotations

import asyncio
import logging

import grpc

from temper.common.seqs import settles
from temper.services.gateway.errors import GatewayError
from temper.v1 import service_pb2

log = logging.getLogger("temper.gateway")
_tasks: set[asyncio.Task] = set()  # held here: the loop keeps only weak references to tasks


def abandon_unless_settled(scheduler, key: str | None, run: str, seq: int, exc: BaseException) -> None:
    """``exc`` ended the verb of (run, seq): unless the scheduler's answer settled the seq, abandon it."""
    if not settles(exc):
        task = asyncio.get_running_loop().create_task(_abandon(scheduler, key, run, seq))
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)


async def _abandon(scheduler, key: str | None, run: str, seq: int) -> None:
    request = service_pb2.AbandonSeqRequest(training_run_id=run, seq_id=seq)
    while True:
        try:
            await scheduler.verb("AbandonSeq", request, key)
            return
        except GatewayError as error:
            if error.code != grpc.StatusCode.UNAVAILABLE:  # nothing to skip (the run is gone): the gap timeout is the backstop
                log.warning("abandoning seq %d of %s: %s", seq, run, error)
                return
        await asyncio.sleep(1.0)  # verb resent it for unavailable_seconds already
