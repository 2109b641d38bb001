"""A trainer or sampler as a Ray actor: the same gRPC service that `python -m temper.services.<role>`
runs, served from a thread of the actor's process.

Ray owns the process: it places the actor on a node with the CPUs and GPUs asked for, and when the
process dies it starts a new one and runs __init__ again with the same arguments. The new process
binds the same port, so on the same node the worker comes back at the same address, empty; the
scheduler restores the runs it held (scheduler/planning/recovery.py). This module imports no Ray at the top:
ray_cluster.py wraps the class with ``ray.remote`` and the options of each actor."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time

log = logging.getLogger("temper.deploy")


def free_address() -> str:
    """This node's IP and a port free on it now: a trainer group's rendezvous (run on rank 0's bundle)."""
    from ray.util import get_node_ip_address

    host = get_node_ip_address()
    with socket.socket() as probe:
        probe.bind((host, 0))
        return f"{host}:{probe.getsockname()[1]}"


def _serve_function(role: str):
    # The services' own entry points, minus their main(): no argv, no process re-exec (the trainer's
    # tuned allocator comes through the actor's runtime_env instead, see ray_cluster.py).
    if role == "trainer":
        from temper.services.trainer.__main__ import PREFIX, serve
    elif role == "sampler":
        from temper.services.sampler.__main__ import PREFIX, serve
    else:
        raise ValueError(f"unknown role {role!r}")
    return PREFIX, serve


class WorkerActor:
    def __init__(self, role: str, settings, port: int):
        """``settings``: the role's TrainerSettings / SamplerSettings, built by the deploying process;
        the bind address is set here, on the node Ray chose."""
        from ray.util import get_node_ip_address

        from temper.common.internal_auth import worker_authenticator
        from temper.common.logs import configure_logging

        prefix, serve = _serve_function(role)
        self.role = role
        host = get_node_ip_address()
        self._address = f"{host}:{port}"
        self.settings = settings.model_copy(update={"bind": self._address})
        configure_logging(self.settings.log_level, self.settings.log_format)
        authenticate = worker_authenticator(self.settings, prefix)  # no token: the actor fails to start, at once
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, args=(serve, authenticate), name=f"temper-{role}", daemon=True)
        self._thread.start()

    def _serve(self, serve, authenticate) -> None:
        try:
            asyncio.run(serve(self.settings, authenticate))
        except BaseException as exc:  # kept for address() to raise: a thread's exception reaches no caller
            log.exception("%s on %s stopped", self.role, self._address)
            self._failure = exc
        else:
            self._failure = RuntimeError(f"{self.role} on {self._address} stopped serving")

    def address(self, timeout: float = 600.0) -> str:
        """host:port once the service serves (its model loaded); raises if it failed to start."""
        deadline = time.monotonic() + timeout
        while True:
            if self._failure is not None:
                raise RuntimeError(f"{self.role} on {self._address} failed: {self._failure!r}") from self._failure
            if self._serving():
                return self._address
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} on {self._address} not serving after {timeout:.0f}s")
            time.sleep(0.2)

    def pid(self) -> int:
        """This incarnation's process id (a test kills it; Ray starts the next one)."""
        return os.getpid()

    def stopped(self) -> str:
        """Returns once the service has stopped (why); a rank of a trainer group that fails leaves
        its process (exit GROUP_FAILED) and the call fails instead. Either way: the group is down."""
        self._thread.join()
        return repr(self._failure)

    def _serving(self) -> bool:
        if self.settings.tls_cert_file is not None:  # no CA here to check the health port's TLS: the port open will do
            try:
                socket.create_connection(self._address.rsplit(":", 1), timeout=1).close()
                return True
            except OSError:
                return False
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self._address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
