"""The scheduler process assembled: store, runs, admission, workers, loop, gRPC server, and the
supervision that turns a dead loop into an honest exit instead of a server that hangs."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket

from sqlalchemy.orm import sessionmaker

from temper.common.errors import Unavailable
from temper.common.metrics import ready_line, serve_metrics
from temper.common.server import build_server, mark_serving
from temper.common.tls import settings_server_credentials
from temper.scheduler.cluster.directory import ReplicaDirectory
from temper.scheduler.cluster.forwarding import Forwarder
from temper.scheduler.cluster.keeper import LeaseKeeper
from temper.scheduler.cluster.ownership import LaneOwner, LaneOwnership, SoleOwner
from temper.scheduler.planning.admission import Admission
from temper.scheduler.planning.handover import LaneHandover
from temper.scheduler.tenancy.auth import LOCAL_TENANT, ApiKeyAuth
from temper.scheduler.workers.backends import Backends
from temper.scheduler.api.checkpoint_verbs import CheckpointCollector
from temper.scheduler.db.named_models import named_base_models
from temper.scheduler.db.store import Store, make_engine, upgrade_schema
from temper.scheduler.planning.loop import SchedulerLoop
from temper.scheduler.workers.membership import Membership
from temper.scheduler.planning.policy import FairShare
from temper.scheduler.planning.records import prune_forever
from temper.scheduler.planning.session_expiry import SessionExpiry
from temper.scheduler.workers.registry import start_registry
from temper.scheduler.tenancy.jwt_tokens import JwtKeys
from temper.scheduler.planning.runs import RunRegistry
from temper.scheduler.api.servicer import TemperServicer
from temper.scheduler.api.cluster_status import ClusterSources
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import service_pb2, service_pb2_grpc

log = logging.getLogger("temper.scheduler")
SERVICE = service_pb2.DESCRIPTOR.services_by_name["Temper"].full_name
EXIT_LOOP_FAILED = 3
EXIT_LEASE_LOST = 4
STOP_GRACE_SECONDS = 2.0


def advertised(bind: str, port: int) -> str:
    """Where other replicas reach this one: bind's host (this machine's name for a wildcard) and the
    port actually bound."""
    host = bind.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SchedulerApp:
    def __init__(self, settings: SchedulerSettings, store=None, backends: Backends | None = None):
        self.settings = settings
        self.store = store if store is not None else Store(settings.database_url)
        self.backends = backends if backends is not None else Backends(settings)
        self.runs = RunRegistry(self.store, on_load=lambda run: self.backends.remember_placement(run.run_id, run.row.trainer))
        self.admission = Admission(self.store, self.runs, settings)
        self.loop = SchedulerLoop(self.admission, self.backends, self.store, self.runs, settings)
        self.servicer = TemperServicer(self.store, self.backends, self.runs, self.admission)
        tokens = JwtKeys(self.store, settings.jwt_seconds, settings.jwt_key_rotate_seconds)
        self.auth = ApiKeyAuth(self.store, settings.auth, settings.key_cache_seconds, tokens)
        self.servicer.forget_key = self.auth.forget  # a key revoked through the API stops at once here, its tokens too
        self.servicer.tokens = tokens  # CreateAuthToken
        self.collector = CheckpointCollector(self.store, self.backends, self.runs, settings)
        self.membership = Membership(self.backends, self.loop.recovery, settings)
        self.servicer.cluster = ClusterSources(self.membership, self.loop.recovery)  # what GetClusterStatus reads
        self.server = self.health = self.registry = None
        self.port = self.metrics_port = self.registry_port = None
        self.ownership: LaneOwner = SoleOwner()
        self.workers_ready = False

    async def start(self) -> None:
        await asyncio.to_thread(self.store.set_tenant_weights, self.settings.tenant_weights)
        self.loop.share = FairShare(weights=await asyncio.to_thread(self.store.tenant_weights),
                                    quantum=self.settings.fair_share_quantum_tokens)
        registration = (service_pb2_grpc.add_TemperServicer_to_server, self.servicer, SERVICE)
        self.server, self.port, self.health = build_server(
            [registration], self.settings.bind, authenticate=self.auth, credentials=settings_server_credentials(self.settings))
        if self.settings.auth == "disabled":
            log.warning("TEMPER_SCHEDULER_AUTH=disabled: no API keys; every caller is tenant %r", LOCAL_TENANT)
        await mark_serving(self.health, [SERVICE], serving=False)  # until the trainers and samplers answer
        await self.server.start()
        if self.settings.replicas:
            self._replicate()
        if self.settings.registry_bind:
            # models served before a restart: until their workers register again, they answer UNAVAILABLE, not NOT_FOUND
            self.backends.known_models.update(await asyncio.to_thread(named_base_models, self.store))
            self.registry, self.registry_port = await start_registry(self.settings, self.membership)
            log.info("worker registry on port %d", self.registry_port)
        self.metrics_port = serve_metrics(self.settings.metrics_bind)

    def _replicate(self) -> None:
        """One replica of several (scheduler/cluster/): lanes by lease, lane writes fenced, verbs of
        another replica's lanes forwarded there."""
        owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"  # one per process incarnation
        address = self.settings.advertise_address or advertised(self.settings.bind, self.port)
        handover = LaneHandover(self.loop, on_health=lambda serving: asyncio.ensure_future(self._set_health()))
        # their own connections: a renewal never waits for one of the store's (a busy pool let leases run out)
        leases = sessionmaker(make_engine(self.settings.database_url, pool_size=2), expire_on_commit=False)
        self.ownership = LaneOwnership(LeaseKeeper(leases), ReplicaDirectory(leases), owner, address,
                                       self.settings.lease_seconds, handover)
        self.store.fence_runs = self.ownership.fence_runs
        self.backends.lane_token_of = self.ownership.token_for  # trainer calls carry it (common/lane_fence.py)
        self.loop.ownership = self.servicer.ownership = self.ownership
        self.servicer.forwarder = Forwarder(owner)
        self.runs.inflight.reread_after = self.settings.lease_seconds / 6
        log.info("scheduler replica %s at %s (leases of %.1f s)", owner, address, self.settings.lease_seconds)

    async def _set_health(self) -> None:
        """SERVING once the workers answered and, for a replica, while its database and leases answer."""
        await mark_serving(self.health, [SERVICE], serving=self.workers_ready and (not self.ownership.replicated or self.ownership.serving))

    async def run(self) -> int:
        """Serve until the server stops (0) or the loop dies (EXIT_LOOP_FAILED: the process supervisor
        restarts the scheduler, and the new process recovers the queue from the database), or, for a
        replica, a lane's lease was taken by another replica (EXIT_LEASE_LOST: restarted the same way)."""
        connecting = asyncio.create_task(self._connect(), name="scheduler-connect")
        loop_task = asyncio.create_task(self.loop.run_forever(), name="scheduler-loop")
        leasing = asyncio.create_task(self.ownership.run_forever(), name="scheduler-leases")
        stopped = asyncio.create_task(self.server.wait_for_termination(), name="scheduler-server")
        collecting = asyncio.create_task(self.collector.run_forever(), name="scheduler-checkpoint-collector")
        sweeping = asyncio.create_task(self.membership.run_forever(), name="scheduler-membership")
        expiring = asyncio.create_task(SessionExpiry(self.store, self.servicer.release_session, self.settings.session_expire_seconds,
                                                     self.settings.session_expire_interval_seconds).run_forever(),
                                       name="scheduler-session-expiry")
        pruning = asyncio.create_task(prune_forever(self.store, self.settings.metrics_retention_seconds,
                                                    self.settings.metrics_max_rows_per_run,
                                                    self.settings.metrics_prune_interval_seconds), name="scheduler-records-prune")
        try:
            await asyncio.wait([loop_task, stopped, leasing], return_when=asyncio.FIRST_COMPLETED)
            if leasing.done():
                exc = leasing.exception() if not leasing.cancelled() else None
                log.critical("replica lease lost: %r; failing waiting requests with UNAVAILABLE and exiting", exc)
                await self.fail_over()
                return EXIT_LEASE_LOST
            if loop_task.done():
                exc = loop_task.exception() if not loop_task.cancelled() else None
                log.critical("the scheduler loop stopped: %r; failing waiting requests with UNAVAILABLE and exiting", exc,
                             exc_info=exc)
                await self.fail_over()
                return EXIT_LOOP_FAILED
            return 0
        finally:
            for task in (connecting, loop_task, stopped, collecting, sweeping, pruning, leasing, expiring):
                task.cancel()
            await self.ownership.stop()  # the leases still held released: the others take those lanes at once
            if self.servicer.forwarder is not None:
                await self.servicer.forwarder.close()
            if self.registry is not None:
                await self.registry.stop(grace=None)
            await self.backends.close()

    def stop_soon(self) -> None:
        """SIGTERM (replicas): not serving, calls under way get a moment to end, then run() returns and
        releases the leases."""
        log.info("SIGTERM: stopping; the leases are released as the server stops")
        self._stopping = asyncio.ensure_future(self._stop_gracefully())

    async def _stop_gracefully(self) -> None:
        await mark_serving(self.health, [SERVICE], serving=False)
        await self.server.stop(grace=STOP_GRACE_SECONDS)

    async def fail_over(self) -> None:
        self.admission.fail_all(Unavailable("the scheduler is restarting; retry"))
        await mark_serving(self.health, [SERVICE], serving=False)
        await asyncio.sleep(0.2)  # the failed calls' statuses leave before the server goes
        await self.server.stop(grace=1.0)

    async def _connect(self) -> None:
        await self.backends.connect()
        while not self.backends.ready:  # with a registry: until a trainer registers
            try:
                await self.backends.wait_ready()
            except Unavailable:
                continue
        self.workers_ready = True
        await self._set_health()
        log.info("scheduler serving on port %d; models: %s", self.port, self.backends.model_names())


async def serve(settings: SchedulerSettings) -> int:
    if settings.auto_migrate:
        await asyncio.to_thread(upgrade_schema, settings.database_url)
    app = SchedulerApp(settings)
    await app.start()
    # Listening (health NOT_SERVING until the workers answer; requests wait for them meanwhile).
    registry = f" registry_port={app.registry_port}" if app.registry_port is not None else ""
    print(ready_line("scheduler", app.port, app.metrics_port) + registry, flush=True)
    if settings.replicas:  # a clean stop releases the leases: the other replicas take the lanes at once, not after the ttl
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, app.stop_soon)
    return await app.run()
