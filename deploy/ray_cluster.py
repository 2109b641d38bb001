"""Temper on a Ray cluster: trainers and samplers as Ray actors, the scheduler as a process beside them.

Ray places each worker actor on a node with the CPUs and GPUs it asks for and restarts it when its
process dies. The scheduler is not an actor: clients need it at one stable address, it keeps no
state of its own (the database does), and it already has a restart story — it exits when its loop
dies and a supervisor starts it again on the same port — so it runs as a child of the deploying
command (temper/localstack.py's process handling, on a fixed port), next to the database.

Membership, two ways (RaySettings.membership):
- registry: the scheduler starts first with a registry port; each actor registers there (address,
  model, an incarnation id that changes on every start), so a restarted actor is seen as new;
- static: the actors start first and the scheduler gets their addresses as fixed lists. A restarted
  actor binds the same port, so on the same node it is the same address; one that Ray moved to another
  node is not found again (use the registry for that).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass

from temper.common.host_allocator import TUNED_MALLOC_ENV
from temper.deploy.actors import WorkerActor
from temper.deploy.settings import RaySettings
from temper.localstack import LocalStack, Service

log = logging.getLogger("temper.deploy")
NAMESPACE = "temper"
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray puts every process of a local cluster on 127.0.0.1


def has_registry() -> bool:
    """Whether this Temper's workers can register with the scheduler (else: static address lists)."""
    from temper.scheduler.settings import SchedulerSettings
    from temper.services.trainer.settings import TrainerSettings

    return "register_with" in TrainerSettings.model_fields and "registry_bind" in SchedulerSettings.model_fields


def runtime_env(settings) -> dict:
    """The actor's Ray runtime_env: a trainer's tuned malloc settings (glibc reads them at process
    start, and an actor cannot re-exec itself as `python -m temper.services.trainer` does)."""
    if getattr(settings, "tune_host_allocator", False):
        return {"env_vars": {name: os.environ.get(name, value) for name, value in TUNED_MALLOC_ENV.items()}}
    return {}


class SchedulerProcess(LocalStack):
    """The scheduler alone, as LocalStack starts and restarts it (same port, same environment)."""

    def start_scheduler(self, env: dict[str, str], timeout: float) -> Service:
        return self._wait_ready(self._launch("scheduler", env), timeout)


@dataclass
class Worker:
    role: str
    index: int
    actor: object  # ray.actor.ActorHandle
    address: str = ""


class RayDeployment:
    def __init__(self, settings: RaySettings):
        self.settings = settings
        self.token = settings.internal_token.get_secret_value() if settings.internal_token else secrets.token_urlsafe(32)
        self.workers: list[Worker] = []
        self.scheduler: SchedulerProcess | None = None
        self.address: str | None = None  # the scheduler's public host:port, once started
        self._ray = None

    # ---- start and stop ---------------------------------------------------------------------

    def start(self) -> str:
        """Connect to (or start) Ray, start the workers and the scheduler; returns the scheduler's address."""
        s = self.settings
        try:
            ray = self._connect()
            data_dir = s.data_dir.resolve()
            env = {"TEMPER_SCHEDULER_DATABASE_URL": s.resolved_database_url(), "TEMPER_SCHEDULER_INTERNAL_TOKEN": self.token}
            extra = {"TEMPER_SCHEDULER_BIND": s.scheduler_bind}
            if os.environ.get("TEMPER_SCHEDULER_METRICS_BIND"):  # LocalStack would put its own free port there
                extra["TEMPER_SCHEDULER_METRICS_BIND"] = os.environ["TEMPER_SCHEDULER_METRICS_BIND"]
            self.scheduler = SchedulerProcess(s.base_model, data_dir, database_url=s.resolved_database_url(), extra_env=extra,
                                              num_trainers=0, num_samplers=0)
            if self.membership == "registry":
                registry = f"{s.registry_host or ray.util.get_node_ip_address()}:{s.registry_port}"
                service = self.scheduler.start_scheduler({**env, "TEMPER_SCHEDULER_REGISTRY_BIND": registry}, s.ready_timeout_seconds)
                self._start_workers(registry)
            else:
                self._start_workers("")
                service = self.scheduler.start_scheduler({
                    **env, "TEMPER_SCHEDULER_TRAINER_ADDRESSES": ",".join(w.address for w in self.of("trainer")),
                    "TEMPER_SCHEDULER_SAMPLER_ADDRESSES": ",".join(w.address for w in self.of("sampler"))}, s.ready_timeout_seconds)
        except BaseException:
            self.stop()
            raise
        host = s.scheduler_bind.rsplit(":", 1)[0]
        self.address = f"{'127.0.0.1' if host in ('', '0.0.0.0', '[::]') else host}:{service.port}"
        return self.address

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self._ray is not None:
            for worker in self.workers:
                try:
                    self._ray.kill(worker.actor, no_restart=True)
                except Exception:  # already gone
                    pass
            self._ray.shutdown()  # a local cluster this process started stops with it
            self._ray = None
        self.workers.clear()

    def __enter__(self) -> "RayDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def membership(self) -> str:
        if self.settings.membership == "auto":
            return "registry" if has_registry() else "static"
        return self.settings.membership

    def _connect(self):
        s = self.settings
        if not s.address:
            # A local cluster is this machine only: keep Ray's own ports on loopback. Ray reads this
            # when it is first imported, so it is set before.
            os.environ.setdefault(LOOPBACK_ONLY, "0")
        import ray

        self._ray = ray
        local = {"num_cpus": s.num_cpus or None, "include_dashboard": False} if not s.address else {}
        ray.init(address=s.address or None, namespace=NAMESPACE, **local)
        log.info("Ray: %s", ray.cluster_resources())
        return ray

    # ---- the workers ------------------------------------------------------------------------

    def _start_workers(self, registry: str) -> None:
        ray, s = self._ray, self.settings
        remote = ray.remote(WorkerActor)
        for role, count, port in (("trainer", s.num_trainers, s.trainer_port), ("sampler", s.num_samplers, s.sampler_port)):
            cpus, gpus = (s.trainer_cpus, s.trainer_gpus) if role == "trainer" else (s.sampler_cpus, s.sampler_gpus)
            for i in range(count):
                settings = self.worker_settings(role, i, registry)
                actor = remote.options(
                    name=f"temper-{role}-{i}", num_cpus=cpus, num_gpus=gpus, max_restarts=s.max_restarts,
                    max_task_retries=s.max_task_retries,
                    max_concurrency=4,  # pid() answers while address() waits for the model to load
                    runtime_env=runtime_env(settings),
                ).remote(role, settings, port + i)
                self.workers.append(Worker(role, i, actor))
        # the actors load their models in parallel
        for worker, address in zip(self.workers, ray.get([w.actor.address.remote(s.ready_timeout_seconds) for w in self.workers])):
            worker.address = address
            log.info("%s-%d serving at %s", worker.role, worker.index, address)

    def worker_settings(self, role: str, index: int, registry: str):
        """The role's settings object for worker ``index``: TEMPER_<ROLE>_* of this process, plus the
        deployment's model, token, folders, threads and registry (the bind address is the actor's)."""
        s, data_dir = self.settings, self.settings.data_dir.resolve()
        if role == "trainer":
            from temper.services.trainer.settings import TrainerSettings as cls

            cpus, gpus = s.trainer_cpus, s.trainer_gpus
            values = {"checkpoint_dir": data_dir / "checkpoints", "offload_dir": data_dir / f"trainer-{index}-offload"}
        else:
            from temper.services.sampler.settings import SamplerSettings as cls

            cpus, gpus = s.sampler_cpus, s.sampler_gpus
            values = {"adapter_dir": data_dir / f"sampler-{index}-adapters"}
        values |= {"internal_token": self.token, "num_threads": max(1, int(cpus))}
        if s.base_model:
            values["base_model"] = s.base_model
        if gpus > 0:
            values["device"] = "cuda"
        if registry:
            values["register_with"] = registry
        return cls(**values)

    # ---- for operators and tests ------------------------------------------------------------

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def pid(self, role: str, index: int = 0) -> int:
        """The process id of a worker actor's current incarnation (waits for one that Ray restarts)."""
        worker = self.of(role)[index]
        return self._ray.get(worker.actor.pid.remote())

    def wait_serving(self, role: str, index: int = 0) -> str:
        worker = self.of(role)[index]
        return self._ray.get(worker.actor.address.remote(self.settings.ready_timeout_seconds))
