"""The replica stacks' helpers for scaleout_replicas.py: who owns which lane (from the database), waiting
for the lanes to settle, and a watchdog that ends a measurement when a process dies unasked."""

from __future__ import annotations

import asyncio
import math
import time

from scaleout_procs import Stack

LEASES = ("SELECT l.lane, r.address FROM lane_leases l JOIN scheduler_replicas r ON r.owner = l.owner "
          "WHERE l.expires_at > now() AND NOT r.stopped")


class ProcessDied(RuntimeError):
    """A scheduler or worker process exited that the benchmark did not kill (e.g. a replica that lost a lease)."""


async def watchdog(stacks: dict, deliberate: set[int]) -> None:
    """Raises once a process of the stacks exits unasked: the clients would resend to it until their deadline."""
    while True:
        for stack in {id(s): s for s in stacks.values()}.values():
            for proc in (*stack.schedulers, stack.workers):
                if proc is not None and proc.process.poll() is not None and proc.process.pid not in deliberate:
                    tail = proc.log_path.read_text(errors="replace").splitlines()[-5:] if proc.log_path.exists() else []
                    raise ProcessDied(f"{proc.name} exited ({proc.process.returncode}) during the measurement; log {proc.log_path}:\n"
                                      + "\n".join(line[:400] for line in tail))
        await asyncio.sleep(0.5)


async def guarded(work, stacks: dict, deliberate: set[int]):
    """``work``'s result, unless the watchdog sees a process die first (then its error)."""
    task, guard = asyncio.ensure_future(work), asyncio.ensure_future(watchdog(stacks, deliberate))
    await asyncio.wait([task, guard], return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        guard.result()  # raises ProcessDied
    guard.cancel()
    await asyncio.gather(guard, return_exceptions=True)
    return task.result()


def _query(database_url: str, sql: str, params: dict | None = None) -> list[tuple]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql), params or {})]
    finally:
        engine.dispose()


def lane_owners(stack: Stack) -> dict[str, str]:
    """Lane (trainer address) -> the address of the replica whose lease on it is current."""
    return dict(_query(stack.database_url, LEASES))


def run_lanes(stack: Stack) -> dict[str, str]:
    """Run id -> the lane it is placed on."""
    return dict(_query(stack.database_url, "SELECT id, trainer FROM training_runs WHERE trainer IS NOT NULL"))


async def wait_balanced(stack: Stack, lanes: int, timeout: float = 60.0) -> dict[str, list[str]]:
    """Until every lane is leased and each replica holds its fair share (a replica that joins later
    gets the idle lanes the first gives up); returns replica address -> its lanes."""
    share = math.ceil(lanes / len(stack.schedulers))
    addresses = stack.address.split(",")
    deadline = time.monotonic() + timeout
    while True:
        owners = await asyncio.to_thread(lane_owners, stack)
        held = {a: sorted(lane for lane, owner in owners.items() if owner == a) for a in addresses}
        if len(owners) == lanes and all(lanes // len(addresses) <= len(v) <= share for v in held.values()):
            return held
        if time.monotonic() > deadline:
            raise RuntimeError(f"lanes not balanced over the replicas after {timeout:.0f} s: {held}")
        await asyncio.sleep(0.2)
