"""Run a trainer service: `python -m temper.services.trainer` (settings from TEMPER_TRAINER_*)."""

from __future__ import annotations

import asyncio
import logging
import sys

from temper.common.errors import Authenticator
from temper.common.host_allocator import reexec_with_tuned_allocator
from temper.common.internal_auth import InternalAuthConfigError, worker_authenticator
from temper.services.trainer.settings import TrainerSettings

log = logging.getLogger("temper.trainer")
PREFIX = TrainerSettings.model_config["env_prefix"].upper()


async def serve(settings: TrainerSettings, authenticate: Authenticator | None) -> None:
    """``authenticate``: ``worker_authenticator(settings, ...)``; None only with internal_auth=disabled."""
    # imported here, after the allocator re-exec: torch is a few seconds to import
    from temper.common.metrics import ready_line, serve_metrics
    from temper.common.registration import start_registration
    from temper.common.lane_fence import LaneFence, fenced_authenticator
    from temper.common.server import build_server, mark_serving
    from temper.common.tls import settings_server_credentials
    from temper.services.models.loading import load_model
    from temper.services.trainer.engine import TrainerEngine
    from temper.services.trainer.servicer import TrainerServicer
    from temper.v1 import trainer_pb2, trainer_pb2_grpc

    service = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
    if authenticate is None:
        log.warning("TEMPER_TRAINER_INTERNAL_AUTH=disabled: anyone who reaches port %s can call this trainer", settings.bind)
    credentials = settings_server_credentials(settings)  # before the model: a bad file fails fast
    if settings.world_size > 1:  # a trainer group (group.py): this rank's device and offload folder
        from temper.services.trainer import group

        try:  # before the weights load: a rank or layout the model cannot take refuses at once
            settings = group.group_settings(settings)
            group.check_layout(settings)
        except ValueError as exc:
            sys.exit(f"temper trainer: rank {settings.rank} of {settings.world_size}: {exc}")
    loaded = load_model(settings.base_model, settings.device, settings.dtype, settings.num_threads)
    if settings.world_size > 1:
        from temper.services.trainer.sharded import GroupJoinTimeout

        try:
            joined = group.join(settings)
        except GroupJoinTimeout as exc:  # a rank never came: the group failed (restarted together)
            print(f"temper trainer: {exc}", file=sys.stderr, flush=True)
            group.fail(str(exc))
        engine = group.build_engine(loaded, settings, joined)
        if settings.rank > 0:
            group.follow(engine, joined)  # never returns: rank 0 serves, this rank runs what it sends
        engine = group.GroupEngine(engine, joined)
    else:
        engine = TrainerEngine(loaded, settings)
    servicer = TrainerServicer(engine)
    registration = (trainer_pb2_grpc.add_TrainerServicer_to_server, servicer, service)
    # a scheduler replica that lost this trainer's lane is refused (common/lane_fence.py)
    server, port, health = build_server([registration], settings.bind, fenced_authenticator(authenticate, LaneFence()), credentials)
    metrics_port = serve_metrics(settings.metrics_bind)
    await server.start()
    await mark_serving(health, [service])
    log.info("trainer for %s listening on port %d", loaded.name, port)
    print(ready_line("trainer", port, metrics_port), flush=True)
    # after the server listens (the scheduler dials back before it counts this trainer); held in a
    # local: an unreferenced task can be garbage-collected while it runs
    registering = start_registration(settings, "trainer", PREFIX, port, loaded.name, settings.max_resident_adapters,
                                     servicer.incarnation)
    await server.wait_for_termination()


def main() -> None:
    settings = TrainerSettings()
    try:  # before the re-exec and torch: without a token the trainer refuses to start, at once
        authenticate = worker_authenticator(settings, PREFIX)
    except InternalAuthConfigError as exc:
        sys.exit(f"temper trainer: {exc}")
    reexec_with_tuned_allocator(settings.tune_host_allocator)
    from temper.common.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    log.info("settings: %s", settings.model_dump_json())
    asyncio.run(serve(settings, authenticate))


if __name__ == "__main__":
    main()
