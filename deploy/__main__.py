"""Run Temper on Ray: `python -m temper.deploy` (settings from TEMPER_RAY_*; see deploy/settings.py).

Starts the trainers and samplers as Ray actors and the scheduler (or TEMPER_RAY_SCHEDULER_REPLICAS
replicas) beside them, prints "TEMPER_READY ray port=<first scheduler's port> address=<host:port[,...]>
trainers=<...> samplers=<...>", then stays in the foreground: Ray restarts dead actors, this process
restarts a scheduler that exits and every rank of a trainer group one rank of which stopped. Ctrl-C or SIGTERM stops all of it (and a
local Ray cluster it started).

The base model's layout (ranks per trainer group, devices per rank, the sampler's tp/dp sizes) comes
from TEMPER_MODEL_CATALOGUE (services/models/catalogue.py); a layout that does not divide the model
is refused before anything starts."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from temper.common.logs import configure_logging
from temper.deploy.ray_cluster import RayDeployment
from temper.deploy.settings import RaySettings

log = logging.getLogger("temper.deploy")
CHECK_SECONDS = 2.0


def supervise(deployment: RayDeployment, stop: threading.Event | None = None, every: float = CHECK_SECONDS) -> None:
    """Until ``stop`` is set (default: forever): start a scheduler (each replica) again (same ports,
    database, workers) when it exits, and a trainer group again, all its ranks, when one of them stopped."""
    stop = stop or threading.Event()
    while not stop.wait(every):
        deployment.scheduler.restart_exited(deployment.settings.ready_timeout_seconds)
        deployment.restart_dead_groups()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def usage() -> str:
    fields = "\n".join(f"  TEMPER_RAY_{name.upper()}: {field.description}" for name, field in RaySettings.model_fields.items())
    return f"{__doc__}\n\nSettings:\n{fields}"


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):  # no other arguments: settings come from the environment
        print(usage())
        return
    settings = RaySettings()
    configure_logging(settings.log_level, settings.log_format)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops everything as Ctrl-C does
    try:
        deployment = RayDeployment(settings)  # reads the model catalogue
    except ValueError as exc:
        sys.exit(f"temper deploy: {exc}")
    with deployment:
        try:
            address = deployment.start()
            signal.signal(signal.SIGTERM, _interrupt)  # again: ray.init put its own handler there (a stack dump, then exit)
            workers = {role: ",".join(w.address for w in deployment.of(role)) for role in ("trainer", "sampler")}
            print(f"TEMPER_READY ray port={address.rsplit(':', 1)[1]} address={address} "
                  f"trainers={workers['trainer']} samplers={workers['sampler']}", flush=True)
            log.info("scheduler log: %s; API keys: python -m temper.scheduler.admin create-key --tenant NAME, on the "
                     "same database", deployment.scheduler.service("scheduler").log_path)
            supervise(deployment)
        except KeyboardInterrupt:
            log.info("stopping")
        except Exception as exc:
            sys.exit(f"temper deploy: {exc}")


if __name__ == "__main__":
    main()
