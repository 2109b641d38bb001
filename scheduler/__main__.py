"""Run the scheduler (the public API): `python -m temper.scheduler` (settings from TEMPER_*)."""

from __future__ import annotations

import asyncio
import logging

from temper.common.server import build_server, configure_logging, mark_serving
from temper.scheduler.backends import Backends
from temper.scheduler.db.store import Store, upgrade_schema
from temper.scheduler.loop import SchedulerLoop
from temper.scheduler.policy import FairShare
from temper.scheduler.servicer import TemperServicer
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import service_pb2, service_pb2_grpc

log = logging.getLogger("temper.scheduler")
SERVICE = service_pb2.DESCRIPTOR.services_by_name["Temper"].full_name


async def serve(settings: SchedulerSettings) -> None:
    if settings.auto_migrate:
        await asyncio.to_thread(upgrade_schema, settings.database_url)
    store = Store(settings.database_url)
    await asyncio.to_thread(store.set_tenant_weights, settings.tenant_weights)
    share = FairShare(weights=await asyncio.to_thread(store.tenant_weights), quantum=settings.fair_share_quantum_tokens)
    backends = Backends(settings.trainer_addresses, settings.sampler_addresses)
    loop = SchedulerLoop(backends, store, settings, share)
    servicer = TemperServicer(store, backends, loop)
    server, port, health = build_server([(service_pb2_grpc.add_TemperServicer_to_server, servicer, SERVICE)], settings.bind)
    await mark_serving(health, [SERVICE], serving=False)  # until the trainers and samplers answer
    await server.start()
    await backends.connect(settings.backend_wait_seconds)
    loop_task = asyncio.create_task(loop.run_forever(), name="scheduler-loop")
    await mark_serving(health, [SERVICE])
    log.info("scheduler listening on port %d; models: %s", port, backends.model_names())
    print(f"TEMPER_READY scheduler port={port}", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        loop_task.cancel()
        await backends.close()


def main() -> None:
    settings = SchedulerSettings()
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
