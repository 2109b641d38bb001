"""Scheduler process settings: environment variables with the TEMPER_SCHEDULER_ prefix.

The names without the SCHEDULER_ part (TEMPER_BIND, TEMPER_DATABASE_URL, TEMPER_TRAINER_ADDRESSES, ...)
were this process's until 0.1 and still work for one release, with a deprecation warning."""

from __future__ import annotations

import json
import os
import typing
import warnings
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from temper.common.settings import ProcessSettings

ENV_PREFIX = "TEMPER_SCHEDULER_"
LEGACY_PREFIX = "TEMPER_"


class SchedulerSettings(ProcessSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    bind: str = Field("127.0.0.1:50051", description="host:port of the public API (port 0 picks a free one).")
    database_url: str = Field("sqlite:///data/temper.db", description="SQLAlchemy URL; postgresql+psycopg2://... in deployment.")
    trainer_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:50061"], description="Comma-separated trainer host:port list.")
    sampler_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:50071"], description="Comma-separated sampler host:port list.")
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
    dispatch_retry_seconds: float = Field(
        10.0, description="How long the loop resends a cycle whose trainer is unreachable (the trainer answers a resent "
                          "seq from memory) before answering UNAVAILABLE; the client's retry then resends it again.")
    auto_migrate: bool = Field(True, description="Run `alembic upgrade head` at start-up.")

    @field_validator("trainer_addresses", "sampler_addresses", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

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
            legacy, current = f"{LEGACY_PREFIX}{name}".upper(), f"{ENV_PREFIX}{name}".upper()
            if legacy in os.environ and current not in os.environ:
                warnings.warn(f"{legacy} is deprecated; use {current}", DeprecationWarning, stacklevel=2)
                raw = os.environ[legacy]
                values[name] = json.loads(raw) if typing.get_origin(field.annotation) is dict else raw
        return values
