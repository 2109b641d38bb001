"""Which lanes this scheduler process may run, and the check its lane writes make.

``SoleOwner``: one scheduler, every lane its own, nothing checked (the default).

``LaneOwnership``: one replica of several on one PostgreSQL database. Once a round (a third of the
lease) it, in order:

    announces itself (scheduler_replicas: its address, for forwarding and the console)
    renews each lease it holds (LeaseLost: another replica has the lane; the replica stops, on_lost)
    reads every replica and lease (the view that ``route`` answers from until the next round)
    takes free or expired lanes, up to its fair share: ceil(lanes / live replicas)
    gives up lanes above its fair share that are idle (releasing first), after SURPLUS_ROUNDS rounds
    above it, so a replica that joins later gets lanes too and a slow announcement moves nothing

The renewer thread (renewer.py) also announces and renews on the same beat, apart from the event
loop, so a busy loop does not let the leases run out. Lease calls use their own thread and
connections, never queued behind the store's.

A round that cannot reach the database marks the replica unhealthy (Health NOT_SERVING) until one
succeeds; its leases run out meanwhile unless the database comes back in time (an expired lease
nobody took is renewed). ``fence_runs`` is the store's check before a lane's rows are written
(``db.request_log``): every run's lane must be held, by token, by the database's clock (fencing.py).

Lanes are trainer addresses; the hooks (planning/handover.py) say which runs are on a lane and
whether it is idle. This layer knows nothing of runs or work.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Protocol

from temper.common.errors import LeaseLost, TemperError, Unavailable
from temper.scheduler.cluster.directory import ClusterView, ReplicaDirectory
from temper.scheduler.cluster.fencing import fenced
from temper.scheduler.cluster.keeper import LeaseKeeper
from temper.scheduler.cluster.lease import Lease
from temper.scheduler.cluster.renewer import Renewer

log = logging.getLogger(__name__)
REFRESH_AT_MOST_EVERY = 0.1  # seconds between two reads of the view that a route miss asks for
SURPLUS_ROUNDS = 3           # rounds in a row above the fair share before idle lanes are given up


class OwnershipHooks(Protocol):
    def lanes(self) -> list[str]: ...                    # every lane (trainer address) this replica could run
    def lane_of(self, run_id: str) -> str | None: ...    # the lane a run is placed on, if known
    def gained(self, lane: str) -> None: ...             # now ours: forget what this process knew of its runs
    def idle(self, lane: str) -> bool: ...               # no work of the lane's runs held here
    def releasing(self, lane: str) -> None: ...          # about to be given up (idle): forget its runs
    def health(self, serving: bool) -> None: ...         # the database and the leases answer (or not)


class LaneOwner(Protocol):
    """What lanes and verbs ask: SoleOwner or LaneOwnership."""
    replicated: bool

    def holds(self, lane: str) -> bool: ...
    def token_for(self, lane: str) -> int | None: ...
    async def route(self, lane: str) -> str | None: ...
    async def run_forever(self) -> None: ...
    async def stop(self) -> None: ...


class SoleOwner:
    """One scheduler process: every lane is its own."""
    replicated = False

    def holds(self, lane: str) -> bool:
        return True

    async def route(self, lane: str) -> str | None:
        return None

    def token_for(self, lane: str) -> int | None:
        return None

    async def run_forever(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        pass


class LaneOwnership:
    replicated = True

    def __init__(self, keeper: LeaseKeeper, directory: ReplicaDirectory, owner: str, address: str, ttl: float,
                 hooks: OwnershipHooks, clock: Callable[[], float] = time.monotonic):
        self.keeper, self.directory, self.hooks, self.clock = keeper, directory, hooks, clock
        self.owner, self.address, self.ttl = owner, address, ttl
        self.leases: dict[str, Lease] = {}
        self._renewed: dict[str, float] = {}    # lane -> clock() when its lease was last taken or renewed
        self._lost: dict[str, int] = {}         # lane -> the token of a lease lost to another replica
        self.view = ClusterView([], [])
        self._viewed = -math.inf
        self.serving = False
        self.rounds = 0
        self._above_fair = 0  # rounds in a row this replica held more than its fair share
        # Lease calls never queue behind the store's work in asyncio's default executor: a renewal that
        # waited there while the scheduler was busy let the lease run out (a replica lost its lanes under load).
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leases")
        # the renewer thread (renewer.py) and the event loop both change the leases: one lock, no I/O under it
        self._lock = threading.Lock()
        self.lost_error: LeaseLost | None = None  # set once a lease was lost (from either side)

    @property
    def live_for(self) -> float:
        """How recently a replica must have been heard to count as live (in the fair share, and as the
        console should show it)."""
        return self.ttl

    # ---- what lanes and verbs ask --------------------------------------------------------------

    def holds(self, lane: str) -> bool:
        """Whether this replica may run ``lane`` now: its lease held and renewed within the ttl by this
        process's clock (a conservative hint; the writes' fence is what the database decides)."""
        return lane in self.leases and self.clock() - self._renewed.get(lane, -math.inf) < self.ttl

    async def route(self, lane: str) -> str | None:
        """None: the lane is this replica's. Else the address of the live replica that holds it;
        Unavailable while nobody does (a dead owner's lease has not run out, or it is being taken)."""
        if self.holds(lane):
            return None
        address = self._holder_address(lane)
        if address is None and self.clock() - self._viewed > REFRESH_AT_MOST_EVERY:
            await self._read_view()
            address = self._holder_address(lane)
        if address is None:
            raise Unavailable(f"no scheduler replica holds the lane of trainer {lane} right now (its owner stopped, or "
                              f"it is changing hands); retry")
        return address

    def _holder_address(self, lane: str) -> str | None:
        holder = self.view.holder(lane)
        if holder is None or holder.owner == self.owner:  # ours by the view but not held: being released or lost
            return None
        if holder.left_for <= self.clock() - self._viewed:  # run out since the view was read (its owner may be dead)
            return None
        return self.view.address_of(holder.owner)

    def token_for(self, lane: str) -> int | None:
        """The fencing token this replica's calls to the lane's trainer carry (common/lane_fence.py): its
        lease's; a lost lease's, so that the trainer refuses what is still in flight; None for a lane
        it never held or gave up cleanly (not the owner: a new run's creation there is not fenced)."""
        lease = self.leases.get(lane)
        return lease.token if lease is not None else self._lost.get(lane)

    def fence_runs(self, db, run_ids: Iterable[str]) -> None:
        """The store's check, first in a lane write's transaction (a worker thread): LeaseLost unless
        every run's lane is held by this replica, by token, by the database's clock."""
        for lane in sorted({self.hooks.lane_of(run_id) or "" for run_id in run_ids}):
            lease = self.leases.get(lane)
            if lease is None:
                raise LeaseLost(lane or "?", 0, f"this replica ({self.owner}) does not hold the lane")
            fenced(db, lease)

    # ---- the rounds ----------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """A round every third of the ttl, and a renewer thread (renewer.py) that renews the leases on
        the same beat whatever the event loop is doing (a busy loop must not let them run out). Raises
        LeaseLost when a held lane was taken by another replica: the caller stops this replica (its
        in-flight calls answered UNAVAILABLE)."""
        lost = asyncio.Event()
        renewer = Renewer(self, self.ttl / 3, lambda: lost.set())
        renewer.start()
        try:
            while True:
                started = self.clock()
                try:
                    await self.round()
                    self._set_serving(True)
                except LeaseLost:
                    self._set_serving(False)
                    raise
                except TemperError as exc:  # the database is unavailable: not serving until a round succeeds
                    log.warning("replica %s: lease round failed: %s", self.owner, exc.message)
                    self._set_serving(False)
                try:
                    await asyncio.wait_for(lost.wait(), max(0.0, self.ttl / 3 - (self.clock() - started)))
                except asyncio.TimeoutError:
                    continue
                self._set_serving(False)
                raise self.lost_error
        finally:
            renewer.stop()

    async def round(self) -> None:
        await self._db(self.directory.announce, self.owner, self.address)
        await self._renew()
        await self._read_view()
        lanes = sorted(set(self.hooks.lanes()))
        fair = math.ceil(len(lanes) / max(1, len(self.view.live_replicas())))
        for lane in lanes:
            if len(self.leases) >= fair:
                break
            if lane not in self.leases and self.view.holder(lane) is None:
                await self._take(lane)
        # Surplus lanes go only after SURPLUS_ROUNDS rounds above the fair share: a replica that was slow to
        # announce once (a busy machine) must not make the others hand lanes back and forth.
        self._above_fair = self._above_fair + 1 if len(self.leases) > fair else 0
        for lane in sorted(self.leases, reverse=True):
            if len(self.leases) <= fair or self._above_fair < SURPLUS_ROUNDS:
                break
            if self.hooks.idle(lane):
                await self._release(lane)
        self.rounds += 1

    async def _db(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _renew(self) -> None:
        await self._db(self.renew_now)

    def renew_now(self) -> None:
        """Announce this replica and renew each lease it holds; any thread (the round's executor, or the
        renewer). LeaseLost when another replica took a lane (the lane is then forgotten here); a lease
        given up meanwhile is left alone."""
        self.directory.announce(self.owner, self.address)
        for lane, lease in list(self.leases.items()):
            started = self.clock()  # the database extends the lease from a moment after this, never before
            try:
                renewed = self.keeper.renew(lease)
            except LeaseLost as exc:
                with self._lock:
                    held = self.leases.get(lane)
                    if held is None or held.token != lease.token:
                        continue  # released (or retaken) meanwhile: not a loss
                    self.leases.pop(lane)
                    self._lost[lane] = lease.token
                    self.lost_error = self.lost_error or exc
                log.critical("replica %s lost the lease of lane %s (token %d): another replica holds it", self.owner, lane,
                             lease.token)
                raise
            with self._lock:
                held = self.leases.get(lane)
                if held is not None and held.token == lease.token:
                    self.leases[lane] = renewed
                    self._renewed[lane] = max(self._renewed.get(lane, -math.inf), started)

    async def _read_view(self) -> None:
        # Live: heard within one ttl (live_for). A replica announces just before it renews, so one silent that
        # long has let its leases run out too: it no longer counts in the fair share, and the others
        # take all of its lanes as soon as its leases expire (with 2 ttl they took only their share).
        self.view = await self._db(self.directory.view, self.live_for)
        self._viewed = self.clock()

    async def _take(self, lane: str) -> None:
        started = self.clock()
        lease = await self._db(self.keeper.acquire, lane, self.owner, self.ttl)
        if lease is None:
            return
        self.hooks.gained(lane)  # before the lease counts as held: no verb runs on stale state
        with self._lock:
            self.leases[lane], self._renewed[lane] = lease, started
        log.info("replica %s took lane %s (token %d)", self.owner, lane, lease.token)

    async def _release(self, lane: str) -> None:
        with self._lock:
            lease = self.leases.pop(lane)  # held no more from here: verbs of the lane are routed elsewhere
        self.hooks.releasing(lane)
        await self._db(self.keeper.release, lease)
        log.info("replica %s gave lane %s up (above its fair share)", self.owner, lane)

    async def stop(self) -> None:
        """A clean shutdown: every lease released and the replica marked stopped, so the others take
        its lanes at once instead of after the ttl."""
        for lane in list(self.leases):
            with self._lock:
                lease = self.leases.pop(lane)
            try:
                await self._db(self.keeper.release, lease)
            except TemperError as exc:
                log.warning("could not release lane %s: %s", lane, exc.message)
        try:
            await self._db(self.directory.stopped, self.owner)
        except TemperError as exc:
            log.warning("could not mark replica %s stopped: %s", self.owner, exc.message)

    def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            self.hooks.health(serving)
