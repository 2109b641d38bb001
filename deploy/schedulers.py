"""The deployment's schedulers: one, or ``scheduler_replicas`` replicas on one PostgreSQL database
(TEMPER_SCHEDULER_REPLICAS, docs/replicas.md), each a process beside the Ray actors (ray_cluster.py says
why the scheduler is not an actor), started and restarted as temper/localstack.py does.

Replica i binds the configured ports plus 100 * i (the public API, the registry, a fixed metrics port;
port 0 stays 0, a free one: the defaults 50051 and 50052 are next to each other, and the workers' ports
follow at 50061 and 50071), advertises where the other replicas reach it, and keeps the ports it bound
across restarts: clients hold every replica's address, workers register with every replica's registry."""

from __future__ import annotations

import logging
import os

from temper.localstack import LocalStack, Service

log = logging.getLogger("temper.deploy")
BIND, METRICS_BIND = "TEMPER_SCHEDULER_BIND", "TEMPER_SCHEDULER_METRICS_BIND"
REGISTRY_BIND, ADVERTISE = "TEMPER_SCHEDULER_REGISTRY_BIND", "TEMPER_SCHEDULER_ADVERTISE_ADDRESS"
OWN = (BIND, METRICS_BIND)  # a replica's own bind addresses, applied over LocalStack's loopback ones
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
PORT_STEP = 100  # replica i's ports: the configured ones + PORT_STEP * i


def check_replicas(replicas: int, database_url: str) -> None:
    """Replicas share their runs through the database's row locks and clock: PostgreSQL only."""
    if replicas > 1 and not database_url.startswith("postgresql"):
        raise ValueError(f"scheduler_replicas={replicas} needs a PostgreSQL database_url (the replicas share their runs "
                         f"and lane leases through it); got {database_url.split(':', 1)[0]}: set TEMPER_RAY_DATABASE_URL "
                         "to postgresql+psycopg2://... or TEMPER_RAY_SCHEDULER_REPLICAS=1")


def nth(bind: str, index: int) -> str:
    """host:port of replica ``index``: the port plus PORT_STEP * index (0 stays 0: a free port for each)."""
    host, port = bind.rsplit(":", 1)
    return f"{host}:{int(port) + PORT_STEP * index if int(port) else 0}"


def public_host(bind: str) -> str:
    """The host a client on this machine dials for ``bind`` (loopback for a wildcard)."""
    host = bind.rsplit(":", 1)[0]
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


class SchedulerProcess(LocalStack):
    """The schedulers alone, as LocalStack starts and restarts them (same ports, same environment)."""

    def _launch(self, role: str, env: dict[str, str], port: int = 0, argv: list[str] | None = None,
                name: str | None = None) -> Service:
        own = {key: env[key] for key in OWN if key in env}
        saved, self.extra_env = self.extra_env, {**self.extra_env, **own}
        try:
            return super()._launch(role, env, port, argv, name=name)
        finally:
            self.extra_env = saved

    def start_scheduler(self, env: dict[str, str], timeout: float, name: str = "scheduler") -> Service:
        """One scheduler; its env then names the ports it bound, so a restart binds them again."""
        service = self._wait_ready(self._launch("scheduler", env, name=name), timeout)
        service.env = {**env, BIND: f"{env.get(BIND, '127.0.0.1:0').rsplit(':', 1)[0]}:{service.port}"}
        if REGISTRY_BIND in env:
            service.env[REGISTRY_BIND] = f"{env[REGISTRY_BIND].rsplit(':', 1)[0]}:{service.registry_port}"
        return service

    def start_replicas(self, settings, env: dict[str, str], node_ip: str, registry: bool) -> list[Service]:
        """``settings.scheduler_replicas`` schedulers (RaySettings), one after the other (each migrates the
        database first); ``registry``: each serves a worker registry."""
        count = settings.scheduler_replicas
        started = []
        for index in range(count):
            own = {BIND: nth(settings.scheduler_bind, index)}
            if os.environ.get(METRICS_BIND):  # else LocalStack's free loopback port
                own[METRICS_BIND] = nth(os.environ[METRICS_BIND], index)
            if count > 1:
                host, port = own[BIND].rsplit(":", 1)
                # where the other replicas forward a lane's verbs; a wildcard bind is reached at this node's IP
                advertise = f"{node_ip if host in WILDCARD_HOSTS else host}:{port}" if int(port) else ""
                own |= {"TEMPER_SCHEDULER_REPLICAS": "true", ADVERTISE: advertise}
            if registry:
                own[REGISTRY_BIND] = nth(f"{settings.registry_host or node_ip}:{settings.registry_port}", index)
            started.append(self.start_scheduler({**env, **own}, settings.ready_timeout_seconds,
                                                "scheduler" if index == 0 else f"scheduler-{index}"))
        return started

    def addresses(self) -> list[str]:
        """Every scheduler's public host:port (what clients dial, round_robin over them)."""
        return [f"{public_host(s.env[BIND])}:{s.port}" for s in self.services_of("scheduler")]

    def registries(self) -> list[str]:
        """Every scheduler's registry host:port (the workers' register_with)."""
        return [s.env[REGISTRY_BIND] for s in self.services_of("scheduler") if REGISTRY_BIND in s.env]

    def restart_exited(self, timeout: float) -> list[str]:
        """Start again, on the same ports, every scheduler whose process exited; returns their names. One
        that does not start again is left down and retried on the next call."""
        restarted = []
        for service in list(self.services_of("scheduler")):
            if service.process.poll() is None:
                continue
            log.warning("%s exited with %s; starting it again", service.name, service.process.returncode)
            try:
                self.restart(service.name, crash=True, timeout=timeout)
            except RuntimeError as exc:
                log.error("%s did not start again: %s", service.name, exc)
                continue
            restarted.append(service.name)
        return restarted
