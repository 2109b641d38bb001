"""Run the gateway: `python -m temper.services.gateway` (settings from TEMPER_GATEWAY_*)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn

from temper.common.logs import configure_logging
from temper.common.metrics import ready_line, serve_metrics
from temper.services.gateway.app import create_app
from temper.services.gateway.settings import GatewaySettings
from temper.services.gateway.upstream import Scheduler

log = logging.getLogger("temper.gateway")


def _listen(bind: str) -> socket.socket:
    """Bind before uvicorn starts, so port 0 gives us the port to announce."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    return sock


async def serve(settings: GatewaySettings) -> None:
    app = create_app(Scheduler.from_settings(settings), settings.long_poll_seconds, settings.future_keep_seconds,
                     settings.max_json_body_bytes, settings.max_protobuf_body_bytes)
    app.state.console_max_rows = settings.console_max_rows
    app.state.image_limits = settings.image_limits()
    app.state.price_table = settings.prices()  # billing usage costs, the cookbook's models.json (routes_billing.py)
    sock = _listen(settings.bind)
    tls = {}
    if settings.tls_cert_file is not None:
        tls = {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
        if settings.tls_client_ca_file is not None:
            tls.update(ssl_ca_certs=str(settings.tls_client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
    # uvicorn's own logging config would replace ours
    config = uvicorn.Config(app, log_config=None, access_log=False, timeout_keep_alive=75, **tls)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # startup failed: raise its error
            raise SystemExit("temper gateway: the HTTP server stopped during startup")
        await asyncio.sleep(0.05)
    port = sock.getsockname()[1]
    metrics_port = serve_metrics(settings.metrics_bind)
    log.info("gateway on port %d (scheduler %s)", port, settings.scheduler_address)
    print(ready_line("gateway", port, metrics_port), flush=True)
    await task


def main() -> None:
    settings = GatewaySettings()
    configure_logging(settings.log_level, settings.log_format)
    log.info("settings: %s", settings.model_dump_json())
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
