"""Scheduler process settings: environment variables with the TEMPER_SCHEDULER_ prefix.

The names without the SCHEDULER_ part (TEMPER_BIND, TEMPER_DATABASE_URL, TEMPER_TRAINER_ADDRESSES, ...)
were this process's until 0.1 and still work for one release, with a deprecation warning."""

from __future__ import annotations

import json
import os
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from temper.common.settings import InternalTokenSettings, ProcessSettings

ENV_PREFIX = "TEMPER_SCHEDULER_"
LEGACY_PREFIX = "TEMPER_"
# Only the names this process had in 0.1 keep their old TEMPER_<FIELD> spelling: a newer field read
# from a generic name (TEMPER_TLS_CERT_FILE, TEMPER_INTERNAL_TOKEN) could pick up another process's value.
LEGACY_FIELDS = ("bind", "database_url", "trainer_addresses", "sampler_addresses", "max_queued_requests", "seq_gap_timeout_seconds",
                 "result_cache_size", "durable_results_per_run", "cycle_token_budget", "fair_share_quantum_tokens",
                 "tenant_weights", "auto_migrate")


class SchedulerSettings(ProcessSettings, InternalTokenSettings):
    """internal_token / internal_token_file (InternalTokenSettings): the secret sent to every trainer and
    sampler. tls_* (ProcessSettings) are the public port's; internal_tls_* the channels to the workers."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    bind: str = Field("127.0.0.1:50051", description="host:port of the public API (port 0 picks a free one).")
    database_url: str = Field("sqlite:///data/temper.db", description="SQLAlchemy URL; postgresql+psycopg2://... in deployment.")
    trainer_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:50061"], description="Comma-separated trainer host:port list.")
    sampler_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:50071"], description="Comma-separated sampler host:port list.")
    # registry (membership.py): workers that register themselves, besides (or instead of) the lists above
    registry_bind: str = Field(
        "", description="host:port of the internal registry where trainers and samplers register and send heartbeats "
                        "(their register_with); empty: no registry, the static address lists only. With a registry, "
                        "trainer_addresses and sampler_addresses default to empty.")
    worker_timeout_seconds: float = Field(
        10.0, gt=0, description="A registered worker silent this long is down: a trainer's runs move to another trainer of "
                                "its model that answers (recovery.py), a sampler is chosen last until it is heard again.")
    registry_tls_cert_file: Path | None = Field(
        None, description="PEM certificate of the registry port; with registry_tls_key_file it serves TLS only.")
    registry_tls_key_file: Path | None = Field(None, description="PEM private key of registry_tls_cert_file.")
    registry_tls_client_ca_file: Path | None = Field(
        None, description="PEM CA; set, every worker must present a certificate it signed to register (mutual TLS).")
    # replicas (scheduler/cluster/, docs/replicas.md)
    replicas: bool = Field(
        False, description="Run as one of several scheduler replicas sharing one PostgreSQL database: each trainer's lane "
                           "is owned by one replica at a time through a lease, and a verb of a lane another replica owns "
                           "is forwarded to it. Off: this process owns every lane (one scheduler).")
    advertise_address: str = Field(
        "", description="host:port other replicas forward a lane's verbs to; empty: bind's host (the host name when "
                        "bind's host is 0.0.0.0 or ::) with the port actually bound.")
    lease_seconds: float = Field(
        3.0, gt=0, description="A lane lease's length: renewed every third of it while the replica is healthy; a dead or "
                               "frozen replica's lanes are taken by the others after at most this long plus a renewal round.")
    # admission
    max_queued_requests: int = Field(1024, description="Queued training requests across all tenants before RESOURCE_EXHAUSTED.")
    max_queued_per_tenant: int = Field(256, description="Queued training requests of one tenant (all its runs) before RESOURCE_EXHAUSTED.")
    max_queued_per_run: int = Field(
        128, description="Requests of one run held by the scheduler, including those parked behind a missing earlier seq; "
                         "parked requests count against their own run only.")
    seq_gap_timeout_seconds: float = Field(
        300.0, description="How long a run's queued requests wait for a missing earlier seq (a client that took a seq "
                           "and never sent it, or died) before the scheduler skips it; 0 waits forever.")
    result_cache_size: int = Field(4096, description="Completed results kept in memory to answer retried (run, seq) requests.")
    durable_results_per_run: int = Field(
        256, description="Answers of each run's most recent requests kept in the database, so a retry after a "
                         "scheduler restart still gets its answer.")
    # batching
    cycle_token_budget: int = Field(65536, description="Most tokens of forward/backward work packed into one trainer cycle.")
    fair_share_quantum_tokens: int = Field(1024, description="Tokens a weight-1 tenant earns per deficit-round-robin round.")
    tenant_weights: dict[str, float] = Field(default_factory=dict, description='Fair-share weights, JSON: {"alice": 2, "bob": 1}.')
    # workers and deadlines
    backend_wait_seconds: float = Field(
        120.0, description="How long a request waits for the trainers and samplers to answer (at start-up) before "
                           "UNAVAILABLE; the scheduler keeps connecting in the background.")
    cycle_timeout_seconds: float = Field(600.0, description="Deadline of one trainer cycle (forward/backward passes and optim steps).")
    trainer_call_timeout_seconds: float = Field(300.0, description="Deadline of the trainer's other calls (create, save, load, read).")
    sampler_call_timeout_seconds: float = Field(300.0, description="Deadline of one sampler call (sample, logprobs, adapter push).")
    sampler_affinity_slack: int = Field(
        4, ge=0, description="A request for an adapter goes to a sampler that holds it unless that sampler has more than this "
                             "many requests in flight beyond the model's least loaded sampler; then the adapter is pushed there.")
    sampler_retry_seconds: float = Field(
        10.0, ge=0, description="How long a sampling call goes on trying the model's samplers when none answers (one "
                                "restarting comes back without its adapters; they are pushed again) before answering "
                                "UNAVAILABLE; 0: each sampler once.")
    dispatch_retry_seconds: float = Field(
        10.0, description="How long the loop resends a cycle whose trainer is unreachable (the trainer answers a resent "
                          "seq from memory) before answering UNAVAILABLE; the client's retry then resends it again.")
    deterministic_runs: bool = Field(False, description="Runs and base-model sampling clients whose creation leaves "
                                     "`deterministic` unset are made in deterministic mode (docs/deterministic.md): how a "
                                     "client that cannot ask, such as the unmodified tinker SDK, gets it. A run or client "
                                     "that asks either way is made as asked.")
    # trainer recovery (scheduler/planning/recovery.py)
    recovery: Literal["snapshot_replay", "off"] = Field(
        "snapshot_replay", description="snapshot_replay: every state-changing request is logged in the database and each run's "
                                       "adapter is snapshotted now and then, so a run whose trainer died (restarted without its "
                                       "adapters, or gone while another trainer of the model answers) is restored from its "
                                       "snapshot and the requests since are replayed, exactly; off: such a run's requests answer "
                                       "FAILED_PRECONDITION.")
    snapshot_every_steps: int = Field(
        10, ge=1, description="A run's adapter is snapshotted after every this many optim steps (the requests since are what "
                              "a restore replays).")
    snapshot_every_seconds: float = Field(
        0.0, ge=0, description="Also snapshot after a run's optim step when its last snapshot is older than this; 0: by steps only.")
    # channels to the workers (common/tls.py): TLS when a CA is set, mutual TLS with a client certificate too
    internal_tls_ca_file: Path | None = Field(
        None, description="PEM CA that signed the trainers' and samplers' certificates; set: the channels use TLS.")
    internal_tls_cert_file: Path | None = Field(
        None, description="PEM client certificate the scheduler presents to workers that require one (mutual TLS).")
    internal_tls_key_file: Path | None = Field(None, description="PEM private key of internal_tls_cert_file.")
    internal_tls_server_name: str = Field(
        "", description="Host name the workers' certificates are checked against instead of the address's host.")
    auto_migrate: bool = Field(True, description="Run `alembic upgrade head` at start-up.")
    # tenancy
    auth: Literal["api_key", "disabled"] = Field(
        "api_key", description="api_key: every public call needs `authorization: Bearer <key>` and its tenant is the key's. "
                               "disabled: no keys, one tenant ('default') — for a single-user laptop only.")
    key_cache_seconds: float = Field(10.0, description="How long a looked-up API key is trusted; a revoked key stops working within it.")
    jwt_seconds: float = Field(
        900.0, ge=120, le=86400, description="Lifetime of a JWT from the key-for-token exchange (CreateAuthToken: the Tinker "
                                            "SDK's default auth, renewed by the SDK at half its life). Revoking its API key "
                                            "ends it within key_cache_seconds, whatever is left of this.")
    jwt_key_rotate_seconds: float = Field(
        86400.0, gt=0, description="A new \"jwt\" signing key is made this often; a token signed with an older key "
                                   "verifies until it expires (the key is retired after this plus jwt_seconds).")
    default_max_training_runs: int = Field(0, description="Open training runs per tenant (sessions not closed); 0: unlimited. "
                                                          "The admin command's set-quota overrides it per tenant.")
    default_max_resident_adapters: int = Field(0, description="A tenant's adapters held by one sampler; loading one more drops "
                                                              "the tenant's least recently used; 0: unlimited.")
    default_train_tokens_per_minute: int = Field(0, description="Tokens a tenant trains per minute before its work waits; 0: unlimited.")
    default_sample_tokens_per_minute: int = Field(0, description="Tokens a tenant samples per minute before its sampling waits; 0: unlimited.")
    default_max_storage_bytes: int = Field(0, description="Bytes of checkpoints per tenant before saves are refused; 0: unlimited.")
    max_import_bytes: int = Field(
        1 << 30, gt=0, description="Largest adapter a client can import (ImportCheckpoint), both files together; an upload is "
                                   "held in the scheduler's memory while it is received.")
    snapshot_idle_seconds: float = Field(
        600.0, description="An ephemeral sampler snapshot (save_weights_and_get_sampling_client) no sampling client used for "
                           "this long, and not its run's newest, is deleted.")
    checkpoint_gc_interval_seconds: float = Field(30.0, description="How often expired checkpoints and idle snapshots are collected.")
    download_url_seconds: float = Field(
        3600.0, gt=0, le=7 * 86400, description="How long a signed download URL of an external_weights checkpoint "
                                                "(get_external_weights_urls) stays valid.")
    download_key_rotate_seconds: float = Field(
        86400.0, gt=0, description="A new \"download\" signing key is made this often; a URL signed with an older key "
                                   "verifies until it expires (the key is retired after this plus download_url_seconds).")
    # records kept after the answer (run_metrics, sampling_records: scheduler/db/records.py)
    metrics_retention_seconds: float = Field(
        30 * 86400.0, ge=0, description="Per-request run metrics and sampling records older than this are deleted; 0: kept "
                                        "until metrics_max_rows_per_run.")
    metrics_max_rows_per_run: int = Field(
        100_000, ge=0, description="A run's newest this many metric rows are kept; older ones are deleted; 0: no cap.")
    metrics_prune_interval_seconds: float = Field(300.0, gt=0, description="How often the records past their retention are deleted.")
    # session expiry (issue 33: scheduler/planning/session_expiry.py)
    session_expire_seconds: float = Field(
        600.0, ge=0, description="A session without a heartbeat, and without work (a request of its runs, a sample), for this "
                                 "long is closed as \"expired\": its checkpoints stay, its "
                                 "runs take no more work and its sampling clients answer as a closed session's do; 0: never. "
                                 "The SDK sends a heartbeat every 10 s.")
    session_expire_interval_seconds: float = Field(
        0.0, ge=0, description="How often the expiry sweep runs; 0: a tenth of session_expire_seconds, between 1 and 30 s.")

    @field_validator("trainer_addresses", "sampler_addresses", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _registry_lists(self):
        # With a registry the workers announce themselves: the loopback defaults would only be waited for.
        if self.registry_bind:
            for name in ("trainer_addresses", "sampler_addresses"):
                if name not in self.model_fields_set:
                    setattr(self, name, [])
        return self

    @model_validator(mode="after")
    def _internal_tls(self):
        if (self.internal_tls_cert_file is None) != (self.internal_tls_key_file is None):
            raise ValueError("internal_tls_cert_file and internal_tls_key_file are set together (or neither)")
        if self.internal_tls_cert_file is not None and self.internal_tls_ca_file is None:
            raise ValueError("internal_tls_cert_file (mutual TLS) needs internal_tls_ca_file")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return init_settings, env_settings, _LegacyEnvSource(settings_cls), dotenv_settings, file_secret_settings


class _LegacyEnvSource(PydanticBaseSettingsSource):
    """TEMPER_<FIELD> for fields whose TEMPER_SCHEDULER_<FIELD> is not set, with a deprecation warning."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values = {}
        for name, field in self.settings_cls.model_fields.items():
            if name not in LEGACY_FIELDS:
                continue
            legacy, current = f"{LEGACY_PREFIX}{name}".upper(), f"{ENV_PREFIX}{name}".upper()
            if legacy in os.environ and current not in os.environ:
                warnings.warn(f"{legacy} is deprecated; use {current}", DeprecationWarning, stacklevel=2)
                raw = os.environ[legacy]
                values[name] = json.loads(raw) if typing.get_origin(field.annotation) is dict else raw
        return values
