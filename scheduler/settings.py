"""Scheduler process settings (environment variables with the TEMPER_ prefix)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TEMPER_")

    bind: str = Field("127.0.0.1:50051", description="host:port of the public API (port 0 picks a free one).")
    database_url: str = Field("sqlite:///data/temper.db", description="SQLAlchemy URL; postgresql+psycopg2://... in deployment.")
    trainer_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:50061"], description="Comma-separated trainer host:port list."
    )
    sampler_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1:50071"], description="Comma-separated sampler host:port list."
    )
    max_queued_requests: int = Field(1024, description="Queued training requests across runs before RESOURCE_EXHAUSTED.")
    cycle_token_budget: int = Field(65536, description="Most tokens of forward/backward work packed into one trainer cycle.")
    fair_share_quantum_tokens: int = Field(1024, description="Tokens a weight-1 tenant earns per deficit-round-robin round.")
    tenant_weights: dict[str, float] = Field(default_factory=dict, description='Fair-share weights, JSON: {"alice": 2, "bob": 1}.')
    seq_gap_timeout_seconds: float = Field(
        300.0, description="How long a run's queued requests wait for a missing earlier seq (a client that took a seq "
                           "and never sent it, or died) before the scheduler skips it; 0 waits forever.")
    durable_results_per_run: int = Field(
        256, description="Answers of each run's most recent requests kept in the database, so a retry after a "
                         "scheduler restart still gets its answer.")
    result_cache_size: int = Field(4096, description="Completed results kept in memory to answer retried (run, seq) requests.")
    backend_wait_seconds: float = Field(120.0, description="How long to wait for trainers and samplers at start-up.")
    auto_migrate: bool = Field(True, description="Run `alembic upgrade head` at start-up.")
    log_level: str = "INFO"

    @field_validator("trainer_addresses", "sampler_addresses", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value
