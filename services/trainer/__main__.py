"""Run a trainer service: `python -m temper.services.trainer` (settings from TEMPER_TRAINER_*)."""

from __future__ import annotations

import asyncio
import logging

from temper.common.server import build_server, configure_logging, mark_serving
from temper.services.models.loading import load_model
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.servicer import TrainerServicer
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger("temper.trainer")
SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


async def serve(settings: TrainerSettings) -> None:
    loaded = load_model(settings.base_model, settings.device, settings.dtype, settings.num_threads)
    engine = TrainerEngine(loaded, settings)
    registration = (trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(engine), SERVICE)
    server, port, health = build_server([registration], settings.bind)
    await server.start()
    await mark_serving(health, [SERVICE])
    log.info("trainer for %s listening on port %d", loaded.name, port)
    print(f"TEMPER_READY trainer port={port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    settings = TrainerSettings()
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
