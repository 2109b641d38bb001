"""Run a sampler service: `python -m temper.services.sampler` (settings from TEMPER_SAMPLER_*)."""

from __future__ import annotations

import asyncio
import logging
import sys

from temper.common.errors import Authenticator
from temper.common.internal_auth import InternalAuthConfigError, worker_authenticator
from temper.common.logs import configure_logging
from temper.common.metrics import ready_line, serve_metrics
from temper.common.registration import start_registration
from temper.common.server import build_server, mark_serving
from temper.common.tls import settings_server_credentials
from temper.services.models.loading import load_model
from temper.services.sampler.backend import SamplerBackend
from temper.services.sampler.servicer import SamplerServicer
from temper.services.sampler.settings import SamplerConfigError, SamplerSettings
from temper.v1 import sampler_pb2, sampler_pb2_grpc

log = logging.getLogger("temper.sampler")
SERVICE = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"].full_name
PREFIX = SamplerSettings.model_config["env_prefix"].upper()


def build_backend(settings: SamplerSettings) -> SamplerBackend:
    """The chosen backend; SamplerConfigError (naming the settings) for a layout it cannot run."""
    if settings.backend == "sglang":  # imported only when chosen: the CPU install has no sglang
        from temper.services.sampler.sglang_backend import SGLangSamplerBackend

        return SGLangSamplerBackend(settings)
    if settings.tp_size > 1 or settings.dp_size > 1:
        raise SamplerConfigError(f"the torch sampler backend runs on one device: TEMPER_SAMPLER_TP_SIZE="
                                 f"{settings.tp_size}, TEMPER_SAMPLER_DP_SIZE={settings.dp_size} need "
                                 f"TEMPER_SAMPLER_BACKEND=sglang (or run more torch samplers)")
    from temper.services.sampler.torch_backend import TorchSamplerBackend

    return TorchSamplerBackend(load_model(settings.base_model, settings.device, settings.dtype, settings.num_threads),
                               settings.device, prefix_cache_bytes=settings.prefix_cache_bytes)


async def serve(settings: SamplerSettings, authenticate: Authenticator | None) -> None:
    """``authenticate``: ``worker_authenticator(settings, ...)``; None only with internal_auth=disabled."""
    if authenticate is None:
        log.warning("TEMPER_SAMPLER_INTERNAL_AUTH=disabled: anyone who reaches port %s can call this sampler", settings.bind)
    credentials = settings_server_credentials(settings)  # before the model: a bad file fails fast
    backend = build_backend(settings)
    base_model = backend.describe().base_model
    servicer = SamplerServicer(backend, settings.adapter_dir, settings.max_num_samples,
                               max_adapters=settings.max_adapters, max_adapter_bytes=settings.max_adapter_bytes,
                               image_limits=settings.image_limits())
    registration = (sampler_pb2_grpc.add_SamplerServicer_to_server, servicer, SERVICE)
    server, port, health = build_server([registration], settings.bind, authenticate, credentials)
    metrics_port = serve_metrics(settings.metrics_bind)
    await server.start()
    await mark_serving(health, [SERVICE])
    log.info("sampler (%s backend) for %s listening on port %d", backend.name, base_model, port)
    print(ready_line("sampler", port, metrics_port), flush=True)
    # after the server listens (the scheduler dials back before it counts this sampler); held in a
    # local: an unreferenced task can be garbage-collected while it runs
    registering = start_registration(settings, "sampler", PREFIX, port, base_model, settings.max_adapters,
                                     servicer.incarnation)
    await server.wait_for_termination()


def main() -> None:
    settings = SamplerSettings()
    try:  # without a token the sampler refuses to start
        authenticate = worker_authenticator(settings, PREFIX)
    except InternalAuthConfigError as exc:
        sys.exit(f"temper sampler: {exc}")
    configure_logging(settings.log_level, settings.log_format)
    log.info("settings: %s", settings.model_dump_json())
    try:
        asyncio.run(serve(settings, authenticate))
    except SamplerConfigError as exc:  # refused before serving: say which settings, no traceback
        sys.exit(f"temper sampler: {exc}")


if __name__ == "__main__":
    main()
