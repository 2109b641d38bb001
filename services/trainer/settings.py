"""Trainer process settings (environment variables with the TEMPER_TRAINER_ prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from temper.common.settings import ModelServiceSettings


class TrainerSettings(ModelServiceSettings):
    """base_model, device, dtype, num_threads, metrics_bind, log_level and log_format come from
    ModelServiceSettings."""

    model_config = SettingsConfigDict(env_prefix="TEMPER_TRAINER_")

    bind: str = Field("127.0.0.1:50061", description="host:port to listen on (port 0 picks a free one).")
    checkpoint_dir: Path = Field(Path("data/checkpoints"), description="Where checkpoint folders are written.")
    max_tokens_per_microbatch: int = Field(4096, description="Padded tokens per forward/backward micro-batch.")
    logprob_chunk_tokens: int = Field(
        0, description="Tokens per chunk of the lm_head + log-softmax; 0 picks one: on CPU as many as keep a chunk's "
                       "float32 logits under 24 MiB (below glibc's 32 MiB mmap threshold, so chunks reuse heap memory), "
                       "on accelerators 1024.")
    activation_checkpointing: bool = Field(True, description="Recompute decoder layers in the backward pass instead of storing their activations.")
    activation_checkpointing_min_tokens: int = Field(
        2048, description="Checkpoint only passes of at least this many padded tokens; smaller passes store their "
                          "activations (little memory, and no recompute).")
    max_resident_adapters: int = Field(0, description="Adapters kept in the model at once (0: no limit); the rest are offloaded.")
    offload_to: Literal["auto", "host", "disk"] = Field("auto", description="Where evicted adapters (weights, grads, Adam state) go: host (memory; "
                                                "pinned on a GPU), disk (offload_dir), or auto: host on accelerators, disk on CPU.")
    offload_dir: Path = Field(Path("data/trainer-offload"), description="Where evicted adapters go with offload_to=disk.")
    default_lora_alpha: float = Field(32.0, description="LoRA alpha when a run does not set one.")
    tune_host_allocator: bool = Field(
        True, description="Start the trainer under glibc malloc settings that keep freed memory for reuse "
                          "(temper.common.host_allocator); MALLOC_* variables already set are kept.")
