"""Temper on a Ray cluster: trainers and samplers as Ray actors, the scheduler as a process beside them.

Ray places each worker actor on a node with the CPUs and GPUs it asks for and restarts it when its
process dies. The scheduler is not an actor: clients need it at one stable address, it keeps no
state of its own (the database does), and it already has a restart story — it exits when its loop
dies and a supervisor starts it again on the same port — so it runs as a child of the deploying
command (temper/localstack.py's process handling, on a fixed port), next to the database. With
scheduler_replicas N > 1 there are N of them on one PostgreSQL database (deploy/schedulers.py): each
on its own ports, the workers register with every one, clients get every address.

Membership, two ways (RaySettings.membership):
- registry: the scheduler starts first with a registry port; each actor registers there (address,
  model, an incarnation id that changes on every start), so a restarted actor is seen as new;
- static: the actors start first and the scheduler gets their addresses as fixed lists. A restarted
  actor binds the same port, so on the same node it is the same address; one that Ray moved to another
  node is not found again (use the registry for that).

Layouts come from the model catalogue (TEMPER_MODEL_CATALOGUE, services/models/catalogue.py): when
the base model's layout has ranks_per_trainer N > 1, each trainer is a group of N rank actors
(services/trainer/group.py) in one STRICT_PACK placement group of N bundles (one node). Rank 0 has
the gRPC port and registers; the group meets at a free port of rank 0's node. Ray does not restart
a rank: a group is restarted as a unit (``restart_dead_groups``, which ``python -m temper.deploy``
calls every few seconds) once any of its ranks has stopped, in the same placement group, so rank 0
comes back at the same address. The sampler's tensor- and data-parallel sizes come from the layout too.

A process already connected to Ray (ray.init before start()) keeps its connection: the deployment
starts its actors there and, on stop(), removes them and its placement groups but leaves Ray up — a
Ray application that embeds Temper, or a test suite that starts one cluster for several deployments.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field

from temper.common.host_allocator import TUNED_MALLOC_ENV
from temper.deploy.actors import WorkerActor, free_address
from temper.deploy.schedulers import SchedulerProcess, check_replicas
from temper.deploy.settings import RaySettings
from temper.services.models.catalogue import CATALOGUE_ENV, Catalogue, ModelLayout, check_divides

log = logging.getLogger("temper.deploy")
NAMESPACE = "temper"
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray puts every process of a local cluster on 127.0.0.1
# How long ray.init waits for a local cluster's GCS server to bind its port (Ray's default: 30 s). On a
# loaded 2-core machine it took longer, and the deployment failed to start ("Timed out waiting for file
# .../gcs_server_port_..."); an operator's own setting wins.
GCS_PORT_WAIT = ("RAY_gcs_server_port_wait_time_s", "120")


def has_registry() -> bool:
    """Whether this Temper's workers can register with the scheduler (else: static address lists)."""
    from temper.scheduler.settings import SchedulerSettings
    from temper.services.trainer.settings import TrainerSettings

    return "register_with" in TrainerSettings.model_fields and "registry_bind" in SchedulerSettings.model_fields


def runtime_env(settings, environ=None) -> dict:
    """The actor's Ray runtime_env: a trainer's tuned malloc settings (glibc reads them at process
    start, and an actor cannot re-exec itself as `python -m temper.services.trainer` does), and, for a
    rank of a trainer group, this process's model catalogue (the rank checks its layout against it; an
    actor's process has the environment of its node's raylet, not this one's)."""
    environ = os.environ if environ is None else environ
    rank_of_group = getattr(settings, "world_size", 1) > 1
    env_vars = {CATALOGUE_ENV: environ[CATALOGUE_ENV]} if rank_of_group and environ.get(CATALOGUE_ENV) else {}
    if getattr(settings, "tune_host_allocator", False):
        env_vars |= {name: environ.get(name, value) for name, value in TUNED_MALLOC_ENV.items()}
    return {"env_vars": env_vars} if env_vars else {}


def group_bundles(layout: ModelLayout, cpus: float, gpus: float) -> list[dict]:
    """The placement group of one trainer group: a bundle per rank, with devices_per_rank GPUs each
    when the trainers use GPUs (``gpus`` > 0)."""
    bundle = {"CPU": cpus} | ({"GPU": layout.devices_per_rank} if gpus > 0 else {})
    return [dict(bundle) for _ in range(layout.ranks_per_trainer)]


def rank_settings(settings, rank: int, world: int, group_addr: str):
    """Trainer settings of one rank of a group meeting at ``group_addr`` (what TEMPER_TRAINER_RANK,
    _WORLD_SIZE and _GROUP_ADDR say to a trainer process)."""
    return settings.model_copy(update={"rank": rank, "world_size": world, "group_addr": group_addr})


def check_layout(catalogue: Catalogue, base_model: str, load_config=None) -> ModelLayout:
    """The base model's layout; a listed one is checked against the model's config (check_divides's
    ValueError when it does not divide)."""
    layout = catalogue.layout(base_model)
    if base_model in catalogue:
        if load_config is None:
            from transformers import AutoConfig

            load_config = AutoConfig.from_pretrained
        check_divides(load_config(base_model), layout, base_model)
    return layout


def planned_registries(settings: RaySettings, node_ip: str) -> list[str]:
    """The registries the schedulers will serve, when every one is on a fixed port; [] when a port is
    free (0: known once the scheduler bound it)."""
    from temper.deploy.schedulers import nth

    first = f"{settings.registry_host or node_ip}:{settings.registry_port}"
    return [nth(first, i) for i in range(settings.scheduler_replicas)] if settings.registry_port else []


def wait_gone(ray, actors: list, timeout: float) -> None:
    """Until each of ``actors`` (killed) is dead, so its name and resources are free again; gives up
    quietly after ``timeout`` (a name still taken then fails the next deployment's start, loudly)."""
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + timeout
    for actor in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(actor.pid.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except RayActorError:
                break
            except Exception:  # noqa: BLE001 - GetTimeoutError: the deadline passed
                return
            time.sleep(0.05)


@dataclass
class Worker:
    role: str
    index: int
    actor: object  # ray.actor.ActorHandle; a trainer group's rank 0
    address: str = ""
    ranks: list = field(default_factory=list)  # a trainer group: every rank's actor, by rank
    group: object = None                       # a trainer group: its placement group
    stops: list = field(default_factory=list)  # a trainer group: each rank's stopped() call, done when it stops


class RayDeployment:
    def __init__(self, settings: RaySettings, catalogue: Catalogue | None = None):
        """``catalogue``: the model layouts (default: TEMPER_MODEL_CATALOGUE)."""
        check_replicas(settings.scheduler_replicas, settings.resolved_database_url())
        self.settings = settings
        self.catalogue = catalogue if catalogue is not None else Catalogue.from_env()
        self.layout = self.catalogue.layout(self.base_model)
        self.token = settings.internal_token.get_secret_value() if settings.internal_token else secrets.token_urlsafe(32)
        self.workers: list[Worker] = []
        self.scheduler: SchedulerProcess | None = None
        self.address: str | None = None  # the schedulers' public host:port, comma-separated, once started
        self.registry = ""                # the schedulers' registries the workers register with ("": static membership)
        self._ray = None
        self._owns_ray = False            # this deployment called ray.init (stop() shuts Ray down)

    # ---- start and stop ---------------------------------------------------------------------

    def start(self) -> str:
        """Connect to (or start) Ray, start the workers and the schedulers; returns the schedulers' addresses
        (one, or each replica's, comma-separated: what clients and the gateway dial)."""
        s = self.settings
        self.layout = check_layout(self.catalogue, self.base_model)  # before Ray: a layout that does not fit is refused at once
        try:
            ray = self._connect()
            node_ip = ray.util.get_node_ip_address()
            env = {"TEMPER_SCHEDULER_DATABASE_URL": s.resolved_database_url(), "TEMPER_SCHEDULER_INTERNAL_TOKEN": self.token}
            self.scheduler = SchedulerProcess(s.base_model, s.data_dir.resolve(), database_url=s.resolved_database_url(),
                                              num_trainers=0, num_samplers=0)
            if self.membership == "registry":
                planned = planned_registries(s, node_ip)
                if planned:  # fixed registry ports: the workers load their models while the schedulers start
                    self._launch_workers(",".join(planned))  # (a worker retries its registration until one serves)
                    self.scheduler.start_replicas(s, env, node_ip, registry=True)
                else:  # the schedulers first: the workers need the registry ports they bind
                    self.scheduler.start_replicas(s, env, node_ip, registry=True)
                    self._launch_workers(",".join(self.scheduler.registries()))
                self._await_workers()
            else:
                self._launch_workers("")
                self._await_workers()
                self.scheduler.start_replicas(s, {
                    **env, "TEMPER_SCHEDULER_TRAINER_ADDRESSES": ",".join(w.address for w in self.of("trainer")),
                    "TEMPER_SCHEDULER_SAMPLER_ADDRESSES": ",".join(w.address for w in self.of("sampler"))}, node_ip, registry=False)
        except BaseException:
            self.stop()
            raise
        self.address = ",".join(self.scheduler.addresses())
        return self.address

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self._ray is not None:
            actors = [a for worker in self.workers for a in (worker.ranks or [worker.actor] if worker.actor else [])]
            self._kill(actors)
            for worker in self.workers:
                if worker.group is not None:
                    self._ray.util.remove_placement_group(worker.group)
            if self._owns_ray:
                self._ray.shutdown()  # a local cluster this process started stops with it
            else:  # Ray stays up: the next deployment there may reuse the actors' names (ray.kill does not wait)
                wait_gone(self._ray, actors, timeout=60)
            self._ray = None
        self.workers.clear()

    def __enter__(self) -> "RayDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def base_model(self) -> str:
        if self.settings.base_model:
            return self.settings.base_model
        from temper.services.trainer.settings import TrainerSettings

        return TrainerSettings().base_model

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
            os.environ.setdefault(*GCS_PORT_WAIT)
        import ray

        self._ray = ray
        if ray.is_initialized():  # this process's own connection: used, and left up by stop()
            log.info("Ray: this process's connection (namespace %s): %s", ray.get_runtime_context().namespace,
                     ray.cluster_resources())
            return ray
        local = {"num_cpus": s.num_cpus or None, "include_dashboard": False} if not s.address else {}
        ray.init(address=s.address or None, namespace=NAMESPACE, **local)
        self._owns_ray = True
        log.info("Ray: %s", ray.cluster_resources())
        return ray

    # ---- the workers ------------------------------------------------------------------------

    def _launch_workers(self, registry: str) -> None:
        """Start every worker actor (a trainer group's ranks included); does not wait for them."""
        ray, s = self._ray, self.settings
        self.registry = registry
        remote = ray.remote(WorkerActor)
        for i in range(s.num_trainers):
            if self.layout.ranks_per_trainer > 1:
                self.workers.append(Worker("trainer", i, None))
                self._start_group(self.workers[-1])
            else:
                self.workers.append(Worker("trainer", i, self._actor(
                    remote, "trainer", i, s.trainer_cpus, s.trainer_gpus, s.max_restarts, s.max_task_retries,
                    self.worker_settings("trainer", i, registry), s.trainer_port + i)))
        sampler_gpus = max(s.sampler_gpus, self.layout.sampler_devices) if s.sampler_gpus > 0 else 0
        for i in range(s.num_samplers):
            self.workers.append(Worker("sampler", i, self._actor(
                remote, "sampler", i, s.sampler_cpus, sampler_gpus, s.max_restarts, s.max_task_retries,
                self.worker_settings("sampler", i, registry), s.sampler_port + i)))

    def _await_workers(self) -> None:
        """Until every worker serves (they load their models in parallel); their addresses."""
        ray, s = self._ray, self.settings
        for worker, address in zip(self.workers, ray.get([w.actor.address.remote(s.ready_timeout_seconds) for w in self.workers])):
            worker.address = address
            log.info("%s-%d serving at %s", worker.role, worker.index, address)

    def _actor(self, remote, role: str, index: int, cpus: float, gpus: float, restarts: int, retries: int, settings, port: int,
               name: str = "", **options):
        return remote.options(
            name=name or f"temper-{role}-{index}", num_cpus=cpus, num_gpus=gpus, max_restarts=restarts,
            max_task_retries=retries,
            max_concurrency=4,  # pid() and stopped() answer while address() waits for the model to load
            runtime_env=runtime_env(settings), **options,
        ).remote(role, settings, port)

    # ---- trainer groups ---------------------------------------------------------------------

    def _start_group(self, worker: Worker) -> None:
        """Start trainer group ``worker.index``: its placement group (made once, kept across restarts),
        a new rendezvous on rank 0's node, one actor per rank on its bundle. Does not wait for them."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, s, n = self._ray, self.settings, self.layout.ranks_per_trainer
        if worker.group is None:
            worker.group = placement_group(group_bundles(self.layout, s.trainer_cpus, s.trainer_gpus), strategy="STRICT_PACK",
                                           name=f"temper-trainer-{worker.index}")
            ray.get(worker.group.ready(), timeout=s.ready_timeout_seconds)

        def on_bundle(rank: int) -> dict:
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(worker.group, placement_group_bundle_index=rank)}

        group_addr = ray.get(ray.remote(num_cpus=0)(free_address).options(**on_bundle(0)).remote(), timeout=120)
        settings = self.worker_settings("trainer", worker.index, self.registry)
        gpus = self.layout.devices_per_rank if s.trainer_gpus > 0 else 0
        remote = ray.remote(WorkerActor)
        worker.ranks = [
            self._actor(remote, "trainer", worker.index, s.trainer_cpus, gpus, 0, 0, rank_settings(settings, rank, n, group_addr),
                        s.trainer_port + worker.index if rank == 0 else 0, name=f"temper-trainer-{worker.index}-rank{rank}",
                        **on_bundle(rank))
            for rank in range(n)]
        worker.actor = worker.ranks[0]
        worker.stops = [actor.stopped.remote() for actor in worker.ranks]
        log.info("trainer-%d: a group of %d ranks meeting at %s", worker.index, n, group_addr)

    def restart_dead_groups(self) -> list[int]:
        """Restart, as a unit, every trainer group one of whose ranks has stopped; returns their indexes.
        A group that fails to start again is left down, and is restarted on the next call."""
        restarted = []
        for worker in self.of("trainer"):
            if not worker.stops or not self._ray.wait(worker.stops, num_returns=1, timeout=0)[0]:
                continue
            log.warning("trainer-%d: a rank of its group stopped; starting all %d ranks again", worker.index, len(worker.ranks))
            self._kill(worker.ranks)
            try:
                self._start_group(worker)
                worker.address = self._ray.get(worker.actor.address.remote(self.settings.ready_timeout_seconds))
            except Exception as exc:  # noqa: BLE001 - a rank died while starting: next time
                log.error("trainer-%d: the group did not start again: %s", worker.index, exc)
                self._kill(worker.ranks)
                continue
            log.info("trainer-%d serving again at %s", worker.index, worker.address)
            restarted.append(worker.index)
        return restarted

    def _kill(self, actors: list) -> None:
        for actor in actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

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
            if self.layout.sampler_tp_size > 1 or self.layout.sampler_dp_size > 1:  # else: the sampler's own settings
                values |= {"tp_size": self.layout.sampler_tp_size, "dp_size": self.layout.sampler_dp_size}
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

    def group_pids(self, index: int = 0) -> list[int]:
        """The process ids of trainer group ``index``'s ranks, by rank."""
        return self._ray.get([actor.pid.remote() for actor in self.of("trainer")[index].ranks])

    def wait_serving(self, role: str, index: int = 0) -> str:
        worker = self.of(role)[index]
        return self._ray.get(worker.actor.address.remote(self.settings.ready_timeout_seconds))
