"""GetClusterStatus: what an operator sees (admin keys only), read from what the scheduler already
holds in memory: the worker handles and their registrations (membership), the runs waiting for a
restore (recovery), each trainer's answered cycles, admission's queues, the tenants' fair-share
weights, and the ring of recent failures and recoveries (workers/events.py). It changes nothing; the
one question it asks is each trainer's memory in use now (GetModelInfo, MEMORY_ASK_SECONDS at most,
all at once; a trainer that does not answer shows 0). A replica (docs/replicas.md) also reads every
replica and lane lease from the database, fresh rather than its ownership loop's last view, so the
operator sees who holds each lane now.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

from temper.scheduler.cluster.directory import ClusterView, LaneHolder, ReplicaDirectory
from temper.scheduler.cluster.ownership import LaneOwner, SoleOwner
from temper.scheduler.tenancy.auth import require_admin
from temper.scheduler.workers import events
from temper.v1 import service_pb2

MEMORY_ASK_SECONDS = 1.0


@dataclass
class ClusterSources:
    """What the servicer does not hold itself (app.py sets it): None parts are shown as unknown."""

    membership: Any = None  # workers.membership.Membership: last heard, down
    recovery: Any = None    # planning.recovery.Recovery: runs whose adapter is being rebuilt


class ClusterStatusVerbs:
    """Mixed into TemperServicer (store, backends, admission and ownership come from it; ``cluster``
    from app.py)."""

    cluster: ClusterSources = ClusterSources()
    ownership: LaneOwner = SoleOwner()  # the servicer's own (LaneOwnership on a replica)

    async def GetClusterStatus(self, request, context):
        require_admin("GetClusterStatus")
        status = service_pb2.ClusterStatus(at_unix_ms=int(time.time() * 1000))
        status.workers.extend(self._worker_statuses(await self._memory_used()))
        status.lanes.extend(self._lane_statuses())
        status.fair_share.extend(await self._fair_share())
        for event in events.EVENTS.newest_first():
            status.events.add(at_unix_ms=int(event.at * 1000), kind=event.kind, what=event.what, worker=event.worker,
                              training_run_id=event.run_id)
        ownership = self.ownership
        if ownership.replicated:  # one scheduler: replicated stays false, every lane in ``lanes`` is its own
            # live by the ownership loop's own window (live_for, where LaneOwnership has one; its view used 2 ttl)
            live_for = getattr(ownership, "live_for", 2 * ownership.ttl)
            view = await asyncio.to_thread(ReplicaDirectory(self.store.sessions).view, live_for)
            replicas, free = replica_statuses(view, ownership.owner, (t.address for t in self.backends.trainers))
            status.replicated = True
            status.replicas.extend(replicas)
            status.free_lanes.extend(free)
        return status

    async def _memory_used(self) -> dict[str, int]:
        up = [t for t in self.backends.trainers if t.address not in self.backends.down]
        used = await asyncio.gather(*(t.memory_used(MEMORY_ASK_SECONDS) for t in up))
        return {t.address: n for t, n in zip(up, used)}

    def _worker_statuses(self, memory_used: dict[str, int]) -> list[service_pb2.WorkerStatus]:
        members = getattr(self.cluster.membership, "members", {}) or {}
        clock = getattr(self.cluster.membership, "clock", time.monotonic)
        pending = set(getattr(self.cluster.recovery, "pending", {}) or {})
        placed = Counter(self.backends.placements.values())
        restoring = {self.backends.placements.get(run_id) for run_id in pending}
        statuses = []
        for trainer in self.backends.trainers:
            member = members.get(("trainer", trainer.address))
            down = trainer.address in self.backends.down or bool(member and member.down)
            state = "down" if down else "restoring" if trainer.address in restoring else "up"
            statuses.append(service_pb2.WorkerStatus(
                role="trainer", address=trainer.address, base_model=trainer.info.base_model, state=state,
                incarnation=trainer.info.incarnation, runs_placed=placed.get(trainer.address, 0),
                memory_capacity_bytes=sum(trainer.info.device_memory_bytes), device=trainer.info.device,
                memory_used_bytes=memory_used.get(trainer.address, 0),
                seconds_since_heard=clock() - member.last_seen if member else -1.0))
        now = time.monotonic()
        for sampler in self.backends.samplers:
            member = members.get(("sampler", sampler.address))
            down = bool(member and member.down) or sampler.suspect_until == float("inf")
            statuses.append(service_pb2.WorkerStatus(
                role="sampler", address=sampler.address, base_model=sampler.info.base_model,
                state="down" if down else "restoring" if sampler.suspect(now) else "up",
                incarnation=sampler.info.incarnation, runs_placed=len(sampler.loaded), device=sampler.info.backend,
                seconds_since_heard=clock() - member.last_seen if member else -1.0))
        return statuses

    def _lane_statuses(self) -> list[service_pb2.LaneStatus]:
        depth: Counter[str] = Counter()
        for run_id, queue in self.admission.queues.items():
            address = self.backends.placements.get(run_id)
            if address is not None:
                depth[address] += len(queue)
        return [service_pb2.LaneStatus(trainer_address=t.address, queue_depth=depth.get(t.address, 0),
                                       cycles_per_minute=float(t.cycles.last_minute()), cycles_total=t.cycles.total)
                for t in self.backends.trainers]

    async def _fair_share(self) -> list[service_pb2.TenantShare]:
        weights = await asyncio.to_thread(self.store.tenant_weights)
        queued = {tenant: held for tenant, (held, _) in self.admission.depth_by_tenant().items() if held}
        busy = sum(weights.get(tenant, 1.0) for tenant in queued) or 0.0
        trained = self.admission.quotas.trained
        return [service_pb2.TenantShare(tenant=tenant, weight=weights.get(tenant, 1.0), queued_requests=queued.get(tenant, 0),
                                        share=weights.get(tenant, 1.0) / busy if tenant in queued else 0.0,
                                        train_tokens_last_minute=float(trained.used(tenant)))
                for tenant in sorted(set(weights) | set(queued))]


def replica_statuses(view: ClusterView, answering: str, known_lanes: Iterable[str]
                     ) -> tuple[list[service_pb2.ReplicaStatus], list[service_pb2.ReplicaLane]]:
    """Each replica with the lanes whose lease names it, and the lanes no listed replica's lease names
    (released, their owner forgotten, or, among ``known_lanes``, never leased): every lane once."""
    replicas = {r.owner: service_pb2.ReplicaStatus(
        owner=r.owner, address=r.address, live=r.live, seconds_since_heard=r.silent_for,
        started_at_unix_ms=_unix_ms(r.started_at), answering=r.owner == answering) for r in view.replicas}
    free = []
    for holder in view.lanes:
        target = replicas[holder.owner].lanes if holder.owner in replicas else free
        target.append(_lane(holder))
    leased = {holder.lane for holder in view.lanes}
    free.extend(service_pb2.ReplicaLane(trainer_address=lane) for lane in sorted(set(known_lanes) - leased))
    return list(replicas.values()), free


def _lane(holder: LaneHolder) -> service_pb2.ReplicaLane:
    return service_pb2.ReplicaLane(trainer_address=holder.lane, token=holder.token, live=holder.live,
                                   lease_age_seconds=holder.age, seconds_left=holder.left_for)


def _unix_ms(at: datetime) -> int:
    return int((at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp() * 1000)
