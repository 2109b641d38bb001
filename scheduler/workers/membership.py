"""Registered workers: who they are, when each was last heard, and what a change means. The Registry
service (``registry.py``) feeds it; ``Backends`` holds the handles the lanes and sampler routing use.

- **Register.** The scheduler dials the worker back (GetModelInfo) before counting it: a worker that
  advertises an address the scheduler cannot reach is told so (UNAVAILABLE, it retries), not added.
  A new address becomes a TrainerHandle (the loop starts its lane) or a SamplerHandle.
- **A new incarnation at a known address**: the worker restarted and holds no adapters. A trainer's
  runs placed there are marked for restore before their next cycle (``Recovery.trainer_restarted``)
  instead of waiting for a cycle to answer NotFound; a sampler forgets the adapters pushed to it
  (``SamplerHandle.adopt``). Handles are kept across restarts: a lane is tied to its handle.
- **Silence** for ``worker_timeout_seconds``: the worker is down. A trainer that does not answer
  GetModelInfo either is taken out of placement and its runs move to another trainer of its model
  that answers (``Recovery.fail_over``; if none answers they wait for it); a sampler is chosen last
  until it is heard again.
- **A heartbeat this scheduler does not know** (the scheduler restarted, or the worker restarted and
  its old process's heartbeat arrives late): NotFound, and the worker registers again.

Workers from the static address lists are not members (they send no heartbeat to miss) unless they
also register.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Protocol

from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from temper.scheduler import metrics
from temper.scheduler.workers.backends import Backends, TrainerHandle
from temper.scheduler.workers.downstream import downstream
from temper.scheduler.workers.events import cluster_event
from temper.scheduler.workers.samplers import SamplerHandle
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import registry_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)
ROLES = {registry_pb2.WORKER_ROLE_TRAINER: "trainer", registry_pb2.WORKER_ROLE_SAMPLER: "sampler"}
DIAL_TIMEOUT_SECONDS = 10.0
STUBS = {"trainer": (trainer_pb2_grpc.TrainerStub, trainer_pb2.GetModelInfoRequest()),
         "sampler": (sampler_pb2_grpc.SamplerStub, sampler_pb2.SamplerModelInfoRequest())}


class TrainerRecovery(Protocol):
    """What membership asks of ``recovery.Recovery``."""

    def trainer_restarted(self, trainer: TrainerHandle) -> list[str]: ...

    async def fail_over(self, dead: TrainerHandle, run_ids) -> bool: ...


@dataclass
class Member:
    role: str            # trainer | sampler
    address: str
    incarnation: str
    last_seen: float     # clock() of its last registration or heartbeat
    down: bool = False   # silent past worker_timeout_seconds, not heard since


class Membership:
    def __init__(self, backends: Backends, recovery: TrainerRecovery, settings: SchedulerSettings,
                 clock: Callable[[], float] = time.monotonic):
        self.backends = backends
        self.recovery = recovery
        self.settings = settings
        self.clock = clock
        self.members: dict[tuple[str, str], Member] = {}
        # registrations of one address one at a time (two must not both add it); others are not held up
        self._locks: dict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    async def register(self, role: int, address: str, incarnation: str) -> None:
        name = ROLES.get(role)
        if name is None:
            raise InvalidArgument(f"unknown worker role {role}: trainer or sampler")
        if not address or not incarnation:
            raise InvalidArgument("a registration names the worker's address and incarnation")
        async with self._locks[(name, address)]:
            await (self._trainer if name == "trainer" else self._sampler)(address, incarnation)
            member = self.members.get((name, address))
            if member is None:
                metrics.MEMBERSHIP_EVENTS.labels(name, "joined").inc()
            elif member.down:
                self._heard_again(member)
            self.members[(name, address)] = Member(name, address, incarnation, self.clock())

    def heartbeat(self, role: int, address: str, incarnation: str) -> None:
        member = self.members.get((ROLES.get(role, "?"), address))
        if member is None or member.incarnation != incarnation:
            raise NotFound(f"this scheduler does not know {ROLES.get(role, 'worker')} {address} (incarnation "
                           f"{incarnation or '?'}): register again")
        member.last_seen = self.clock()
        if member.down:
            self._heard_again(member)

    async def sweep(self) -> None:
        """Mark the members silent past worker_timeout_seconds down (once per silence)."""
        now = self.clock()
        for member in list(self.members.values()):
            if member.down or now - member.last_seen <= self.settings.worker_timeout_seconds:
                continue
            member.down = True
            metrics.MEMBERSHIP_EVENTS.labels(member.role, "down").inc()
            log.warning("%s %s sent no heartbeat for %.1f s: down", member.role, member.address, now - member.last_seen)
            cluster_event("failure", f"{member.role} {member.address} sent no heartbeat for {now - member.last_seen:.1f} s: down",
                          member.address)
            if member.role == "trainer":
                await self._trainer_silent(self.backends.trainer_at(member.address))
            else:
                sampler = self.backends.sampler_at(member.address)
                sampler.suspect_until, sampler.recheck = math.inf, True  # tried last; asked who it is before use
                if given_up := sampler.abandon():  # a frozen sampler's calls: their requests go to another sampler
                    log.warning("gave up %d calls waiting on sampler %s", given_up, member.address)

    async def run_forever(self) -> None:
        every = min(1.0, self.settings.worker_timeout_seconds / 4)
        while True:
            await asyncio.sleep(every)
            await self.sweep()

    # ---- one worker ------------------------------------------------------------------------------

    async def _trainer(self, address: str, incarnation: str) -> None:
        handle = self.backends.trainer_at(address)
        stub, info = await self._reach("trainer", handle, address, incarnation)
        if handle is None:
            self.backends.add_trainer(TrainerHandle(address, stub, info, self.settings))
            return
        before, handle.info = handle.info.incarnation, info
        if before and before != incarnation:
            metrics.MEMBERSHIP_EVENTS.labels("trainer", "restarted").inc()
            runs = self.recovery.trainer_restarted(handle)
            cluster_event("failure", f"trainer {address} restarted (incarnation {before} -> {incarnation}): "
                          f"{len(runs)} runs to restore", address)
            log.warning("trainer %s restarted (incarnation %s -> %s): its %d runs are restored before their next cycle",
                        address, before, incarnation, len(runs))

    async def _sampler(self, address: str, incarnation: str) -> None:
        handle = self.backends.sampler_at(address)
        stub, info = await self._reach("sampler", handle, address, incarnation)
        if handle is None:
            self.backends.add_sampler(SamplerHandle(address, stub, info, self.settings))
            return
        if handle.info.incarnation != incarnation:
            metrics.MEMBERSHIP_EVENTS.labels("sampler", "restarted").inc()
            cluster_event("failure", f"sampler {address} restarted: the adapters pushed before are gone", address)
        handle.adopt(info)  # a new incarnation forgets the adapters pushed before
        handle.recheck, handle.suspect_until = False, 0.0

    async def _reach(self, role: str, handle, address: str, incarnation: str):
        """The stub and model info of the worker at ``address``, asked there (a new channel for a new
        address, closed again if it does not answer); Unavailable if it does not answer."""
        stub_class, request = STUBS[role]
        channel = self.backends.channel(address) if handle is None else None
        stub = handle.stub if handle is not None else stub_class(channel)
        what = f"{role} {address}"
        try:
            async with downstream(f"{what} (the address it registered)"):
                # a known address's channel may still be backing off from the process that died there
                info = await stub.GetModelInfo(request, timeout=DIAL_TIMEOUT_SECONDS, wait_for_ready=handle is not None)
            if info.incarnation and info.incarnation != incarnation:
                raise FailedPrecondition(f"{what} answers as incarnation {info.incarnation}, not {incarnation}: "
                                         f"another process holds that address")
        except Unauthenticated as exc:  # the worker refused the scheduler's token: say which side is wrong
            await self.backends.close_channel(channel)
            raise FailedPrecondition(f"{what} refused the scheduler's internal token ({exc.message}): "
                                     f"TEMPER_SCHEDULER_INTERNAL_TOKEN must be the worker's INTERNAL_TOKEN") from None
        except BaseException:
            await self.backends.close_channel(channel)
            raise
        return stub, info

    def _heard_again(self, member: Member) -> None:
        member.down = False
        metrics.MEMBERSHIP_EVENTS.labels(member.role, "back").inc()
        log.info("%s %s is heard again", member.role, member.address)
        cluster_event("recovery", f"{member.role} {member.address} is heard again", member.address)
        if member.role == "trainer":
            self.backends.mark_up(member.address)  # new runs may go there again
        else:
            self.backends.sampler_at(member.address).suspect_until = 0.0

    async def _trainer_silent(self, trainer: TrainerHandle) -> None:
        if await trainer.ping():  # only its heartbeats are lost: the scheduler still reaches it, its runs stay
            log.warning("trainer %s sends no heartbeat but answers: its runs stay there", trainer.address)
            return
        self.backends.mark_down(trainer.address)  # no new runs go there meanwhile
        if not await self.recovery.fail_over(trainer, ()):
            log.warning("trainer %s does not answer and no other trainer of %s does: its runs wait for it",
                        trainer.address, trainer.info.base_model)
