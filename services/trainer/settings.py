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
    max_tokens_per_microbatch: int = Field(
        0, description="At most this many padded tokens per forward/backward micro-batch (a row longer than that runs "
                       "alone); 0: 1024 on CPU (where bigger passes cost more per token), no cap on accelerators (the "
                       "activation memory budget alone splits passes); 4096 under the deprecated token rule.")
    logprob_chunk_tokens: int = Field(
        0, description="Tokens per chunk of the lm_head + log-softmax; 0 picks one: on CPU as many as keep a chunk's "
                       "float32 logits under 24 MiB (below glibc's 32 MiB mmap threshold, so chunks reuse heap memory), "
                       "on accelerators 1024.")
    activation_memory_mib: int = Field(
        0, description="Memory the activations of one forward/backward pass may use, MiB. A pass that fits it stores "
                       "its activations; a bigger one is split into micro-batches that fit, and checkpointed only "
                       "where those would be too small (estimated from the model config: temper.services.trainer.memory). "
                       "0: activation_memory_fraction of the memory available when the trainer starts (host "
                       "MemAvailable on CPU, free device memory on accelerators).")
    activation_memory_fraction: float = Field(
        0.5, gt=0, le=1, description="The share of available memory the activation budget takes when activation_memory_mib is 0.")
    activation_checkpointing: bool = Field(
        True, description="Recompute decoder layers in the backward pass when a pass cannot fit the activation memory "
                          "budget otherwise; false: never (passes are only split into micro-batches).")
    activation_checkpointing_min_tokens: int | None = Field(
        None, description="Deprecated: the old token rule, checkpoint every pass of at least this many padded tokens "
                          "whatever memory it needs (micro-batches of max_tokens_per_microbatch, or 4096). Unset: "
                          "memory decides (activation_memory_mib).")
    lora_math_dtype: Literal["activation", "float32"] = Field(
        "activation", description="dtype of the LoRA matmuls: the activations' (bfloat16 on a bfloat16 base; float32 "
                                  "on a float32 one) or always float32. Adapters, their gradients and Adam state are "
                                  "float32 either way.")
    max_resident_adapters: int = Field(0, description="Adapters kept in the model at once (0: no limit); the rest are offloaded.")
    offload_to: Literal["auto", "host", "disk"] = Field("auto", description="Where evicted adapters (weights, grads, Adam state) go: host (memory; "
                                                "pinned on a GPU), disk (offload_dir), or auto: host on accelerators, disk on CPU.")
    offload_dir: Path = Field(Path("data/trainer-offload"), description="Where evicted adapters go with offload_to=disk.")
    default_lora_alpha: float = Field(32.0, description="LoRA alpha when a run does not set one.")
    tune_host_allocator: bool = Field(
        True, description="Start the trainer under glibc malloc settings that keep freed memory for reuse "
                          "(temper.common.host_allocator); MALLOC_* variables already set are kept.")
    # ---- a trainer group: one trainer to the scheduler, its base model sharded over N ranks (group.py) ----
    world_size: int = Field(
        1, ge=1, description="Processes in this trainer's group (issue 20, docs/sharding.md): the base model's weights are "
                             "sharded over them and every cycle's rows split between them. 1: one process, no "
                             "torch.distributed at all.")
    rank: int = Field(0, ge=0, description="This process's rank in the group: rank 0 serves gRPC and registers, the others "
                                           "follow it (world_size > 1 only).")
    group_addr: str = Field("127.0.0.1:29500", description="host:port of rank 0's rendezvous (torch.distributed TCP store); "
                                                          "every rank of the group gets the same one.")
    group_timeout_seconds: float = Field(
        60.0, gt=0, description="How long ranks wait for each other to join the group, and for a collective, before the "
                                "group counts as failed (the ranks exit non-zero and are restarted together).")
