"""Sampler process settings (environment variables with the TEMPER_SAMPLER_ prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from temper.common.settings import ModelServiceSettings


class SamplerSettings(ModelServiceSettings):
    """base_model, device, dtype, num_threads, metrics_bind, log_level and log_format come from
    ModelServiceSettings."""

    model_config = SettingsConfigDict(env_prefix="TEMPER_SAMPLER_")

    bind: str = Field("127.0.0.1:50071", description="host:port to listen on (port 0 picks a free one).")
    backend: Literal["torch"] = Field("torch", description="Sampling backend; 'sglang' arrives with the GPU work.")
    adapter_dir: Path = Field(Path("data/sampler-adapters"), description="Where pushed adapters are unpacked.")
    max_num_samples: int = Field(64, description="Upper bound on num_samples per request.")
    max_adapters: int = Field(16, ge=1, description="Adapters kept loaded at once; loading one more evicts the least "
                                                     "recently used one that no request is using.")
    max_adapter_bytes: int = Field(0, ge=0, description="Bytes of pushed adapter files kept loaded at once (0: no "
                                                         "bound); evicts like max_adapters.")
