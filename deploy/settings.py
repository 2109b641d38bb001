"""Settings of the Ray deployment command (environment variables with the TEMPER_RAY_ prefix).

They say where Ray is, how many workers to start and with what resources. The services' own
settings still come from their own variables: TEMPER_TRAINER_* and TEMPER_SAMPLER_* set where this
command runs are read here and shipped to the actors (all but the bind address, which each actor
sets for its node), and TEMPER_SCHEDULER_* reach the scheduler process unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from temper.common.settings import LogFormat, LogLevel


class RaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TEMPER_RAY_")

    address: str = Field(
        "", description="The Ray cluster: empty starts a local one on this machine (loopback only); 'auto' joins the "
                        "cluster this machine is a node of; 'ray://head:10001' connects as a Ray Client (ray[client]).")
    num_cpus: int = Field(0, ge=0, description="Logical CPUs of a local cluster (0: Ray counts this machine's).")
    num_trainers: int = Field(1, ge=1, description="Trainer actors.")
    num_samplers: int = Field(1, ge=1, description="Sampler actors.")
    trainer_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each trainer actor (also its torch threads).")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each trainer actor (>0: device cuda).")
    sampler_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each sampler actor (also its torch threads).")
    sampler_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each sampler actor (>0: device cuda).")
    base_model: str = Field("", description="Base model of every worker; empty: TEMPER_TRAINER_BASE_MODEL's (or its default).")
    # Fixed ports: an actor that Ray restarts binds the same port again, so on the same node it keeps
    # its address, and the scheduler's placements (a run's trainer is an address) stay valid.
    trainer_port: int = Field(50061, ge=1, description="Trainer i listens on trainer_port + i of its node.")
    sampler_port: int = Field(50071, ge=1, description="Sampler i listens on sampler_port + i of its node.")
    max_restarts: int = Field(-1, ge=-1, description="How often Ray restarts a dead actor (-1: always).")
    max_task_retries: int = Field(3, ge=-1, description="How often a call to an actor (address, pid) is retried across its restarts.")
    membership: Literal["auto", "registry", "static"] = Field(
        "auto", description="registry: the workers register with the scheduler's registry (a restarted actor announces "
                            "its new incarnation); static: the scheduler gets the actors' addresses as fixed lists; "
                            "auto: registry when this version of Temper has one.")
    registry_host: str = Field("", description="Host the scheduler's registry binds and workers dial; empty: this node's Ray IP.")
    registry_port: int = Field(50052, ge=0, description="Port of the scheduler's registry (0: a free one; replica i: port + 100 * i).")
    scheduler_bind: str = Field(
        "127.0.0.1:50051", description="host:port of the scheduler's public API (what clients dial); replica i binds port + 100 * i.")
    scheduler_replicas: int = Field(
        1, ge=1, description="Scheduler processes; > 1: replicas on one PostgreSQL database (TEMPER_SCHEDULER_REPLICAS, "
                             "docs/replicas.md), replica i on the ports of scheduler_bind, registry_port and a fixed "
                             "TEMPER_SCHEDULER_METRICS_BIND plus 100 * i; clients get every address, comma-separated.")
    database_url: str = Field("", description="The scheduler's database; empty: SQLite under data_dir. Postgres in production.")
    data_dir: Path = Field(
        Path("data/ray"), description="Trainer checkpoints (shared by all trainers: on a multi-node cluster, a shared "
                                      "filesystem mounted at the same path), sampler adapters, logs, the default SQLite.")
    internal_token: SecretStr | None = Field(
        None, description="The scheduler's credential to its workers; empty: a new random one per deployment.")
    ready_timeout_seconds: float = Field(600.0, gt=0, description="How long to wait for each worker and the scheduler to serve.")
    log_level: LogLevel = Field("INFO", description="Logging level of this command.")
    log_format: LogFormat = Field("text", description="text or json.")

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir.resolve() / 'temper.db'}"
