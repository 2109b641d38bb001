"""Sampler process settings (environment variables with the TEMPER_SAMPLER_ prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SamplerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TEMPER_SAMPLER_")

    base_model: str = Field("HuggingFaceTB/SmolLM2-135M-Instruct", description="Base model name, local folder or hub id.")
    bind: str = Field("127.0.0.1:50071", description="host:port to listen on (port 0 picks a free one).")
    backend: Literal["torch"] = Field("torch", description="Sampling backend; 'sglang' arrives with the GPU work.")
    adapter_dir: Path = Field(Path("data/sampler-adapters"), description="Where pushed adapters are unpacked.")
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 0
    max_num_samples: int = Field(64, description="Upper bound on num_samples per request.")
    log_level: str = "INFO"
