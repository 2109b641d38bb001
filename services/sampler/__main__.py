"""Run a sampler service: `python -m temper.services.sampler` (settings from TEMPER_SAMPLER_*)."""

from __future__ import annotations

import asyncio
import logging

from temper.common.logs import configure_logging
from temper.common.metrics import ready_line, serve_metrics
from temper.common.server import build_server, mark_serving
from temper.services.models.loading import load_model
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.settings import SamplerSettings
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.v1 import sampler_pb2, sampler_pb2_grpc

log = logging.getLogger("temper.sampler")
SERVICE = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"].full_name


async def serve(settings: SamplerSettings) -> None:
    loaded = load_model(settings.base_model, settings.device, settings.dtype, settings.num_threads)
    backend = TorchSamplerBackend(loaded, settings.device)
    servicer = SamplerServicer(backend, settings.adapter_dir, settings.max_num_samples)
    server, port, health = build_server([(sampler_pb2_grpc.add_SamplerServicer_to_server, servicer, SERVICE)], settings.bind)
    metrics_port = serve_metrics(settings.metrics_bind)
    await server.start()
    await mark_serving(health, [SERVICE])
    log.info("sampler (%s backend) for %s listening on port %d", backend.name, loaded.name, port)
    print(ready_line("sampler", port, metrics_port), flush=True)
    await server.wait_for_termination()


def main() -> None:
    settings = SamplerSettings()
    configure_logging(settings.log_level, settings.log_format)
    log.info("settings: %s", settings.model_dump_json())
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
