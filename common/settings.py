"""Settings fields every Temper process shares. Each process has one settings object, a subclass
of these read from environment variables under its own prefix (TEMPER_SCHEDULER_, TEMPER_TRAINER_,
TEMPER_SAMPLER_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LogFormat = Literal["text", "json"]


class ProcessSettings(BaseSettings):
    """What any Temper server process has: where it listens, how it logs, where its metrics are."""

    bind: str = Field("127.0.0.1:0", description="host:port of the gRPC server (port 0 picks a free one).")
    metrics_bind: str = Field(
        "", description="host:port of the Prometheus /metrics HTTP endpoint (port 0 picks a free one); empty: no endpoint.")
    log_level: LogLevel = Field("INFO", description="Python logging level.")
    log_format: LogFormat = Field("text", description="text: one human-readable line per record; json: one JSON object per line.")


class ModelServiceSettings(ProcessSettings):
    """Processes that load the base model (trainer, sampler)."""

    base_model: str = Field("HuggingFaceTB/SmolLM2-135M-Instruct", description="Base model name, local folder or hub id.")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Base model dtype (adapters always train in float32).")
    num_threads: int = Field(0, description="torch intra-op threads; 0 keeps torch's default.")
