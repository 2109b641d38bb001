"""Sampler process settings (environment variables with the TEMPER_SAMPLER_ prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from temper.common.settings import ModelServiceSettings


class SamplerConfigError(ValueError):
    """Settings the chosen backend cannot run with: the sampler refuses to start (naming them)."""


class SamplerSettings(ModelServiceSettings):
    """base_model, device, dtype, num_threads, metrics_bind, log_level and log_format come from
    ModelServiceSettings."""

    model_config = SettingsConfigDict(env_prefix="TEMPER_SAMPLER_")

    bind: str = Field("127.0.0.1:50071", description="host:port to listen on (port 0 picks a free one).")
    backend: Literal["torch", "sglang"] = Field(
        "torch", description="Sampling backend: torch (CPU or GPU, always installed) or sglang (CUDA only; needs "
                             "`pip install temper[sglang]`; see sglang_backend.py).")
    adapter_dir: Path = Field(Path("data/sampler-adapters"), description="Where pushed adapters are unpacked.")
    max_num_samples: int = Field(64, description="Upper bound on num_samples per request.")
    max_adapters: int = Field(16, ge=1, description="Adapters kept loaded at once; loading one more evicts the least "
                                                     "recently used one that no request is using.")
    max_adapter_bytes: int = Field(0, ge=0, description="Bytes of pushed adapter files kept loaded at once (0: no "
                                                         "bound); evicts like max_adapters.")
    prefix_cache_bytes: int = Field(1 << 30, ge=0, description="Bytes of prompt-prefix KV the torch backend keeps "
                                                               "per process to reuse across a sampling session's "
                                                               "requests (prefix_cache.py); least recently used "
                                                               "evicted first; 0 disables.")

    tp_size: int = Field(1, ge=1, description="Tensor-parallel size: GPUs one model replica is split over (sglang "
                                              "only; the torch backend runs on one device and refuses more).")
    dp_size: int = Field(1, ge=1, description="Data-parallel size: model replicas in this sampler (sglang only, and "
                                              "SGLang 0.5.23 loads adapters at runtime only with 1: see "
                                              "sglang_backend.check_parallel; run more samplers instead).")

    # ---- the sglang backend only (ignored by torch) ------------------------------------------
    sglang_max_loras_per_batch: int = Field(8, ge=1, description="Distinct adapters (the base model counts as one) "
                                                                  "SGLang decodes in one running batch.")
    sglang_max_lora_rank: int = Field(64, ge=1, description="Largest adapter rank SGLang reserves memory for; a pushed "
                                                            "adapter of a higher rank is refused (INVALID_ARGUMENT).")
    sglang_lora_target_modules: list[str] = Field(["all"], description="Modules SGLang can apply LoRA to ('all': every "
                                                                       "supported one); adapters may target a subset.")
    sglang_deterministic: bool = Field(True, description="SGLang's deterministic inference: the only mode in which it "
                                                          "honours per-request seeds. Off: faster, and a request with a "
                                                          "seed is refused (INVALID_ARGUMENT naming seed).")
    sglang_mem_fraction_static: float = Field(0.8, gt=0, lt=1, description="GPU memory fraction SGLang takes for "
                                                                            "weights and KV cache.")
    sglang_sampling_mask_max_tokens: int = Field(4096, ge=1, description="Largest sampling support SGLang reports; "
                                                                          "processed_logprobs with temperature > 0 "
                                                                          "needs top_k in [1, this].")
    sglang_engine_args: dict[str, Any] = Field({}, description="More sglang.Engine keyword arguments (ServerArgs "
                                                                "fields, JSON), e.g. {\"attention_backend\": \"fa3\"}.")
