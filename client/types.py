"""Request and response types, shaped after the Tinker SDK's ``tinker.types`` so a Tinker script
ports by changing its imports. numpy only; torch tensors are accepted and converted if given."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from temper.client.image_types import (  # noqa: F401  (public here too)
    ImageAsset, ImageAssetPointerChunk, ImageChunk, ImageFormat, VisionInfo)
from temper.client.versions import VersionSpan, WeightsVersion  # noqa: F401  (public here too)
from temper.common.optim import AdamParams  # noqa: F401  (public here: temper.client.AdamParams)

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
StopReason = Literal["stop", "length"]
TensorDtype = Literal["int64", "float32"]
CheckpointType = Literal["training", "sampler", "external"]
ModelID = str
OptimParams = AdamParams  # Temper's only optimizer is AdamW


@dataclass(frozen=True)
class AdamOptimizerConfig:
    """Tinker's optimizer choice at run creation; AdamW is the only one Temper has."""

    type: Literal["adamw"] = "adamw"


@dataclass
class TensorData:
    """A dense tensor: flat ``data`` + ``dtype`` ("int64" | "float32" | ...) + ``shape``."""

    data: Any
    dtype: str
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorData":
        arr = np.asarray(array)
        dtype = {"f": "float32", "i": "int64", "u": "int64", "b": "int64"}[arr.dtype.kind]
        if arr.dtype == np.int32:
            dtype = "int32"
        return cls(data=arr, dtype=dtype, shape=list(arr.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> "TensorData":
        return cls.from_numpy(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        arr = np.asarray(self.data, dtype=self.dtype)
        return arr.reshape(self.shape) if self.shape is not None else arr

    def to_torch(self):
        import torch

        return torch.from_numpy(np.array(self.to_numpy(), copy=True))

    def tolist(self) -> list:
        return self.to_numpy().tolist()


# Tinker's dtypes for loss_fn_inputs by key (tinker.types.datum._KEY_TO_TYPE): a plain list of ints
# given as "weights" is float32, as "target_tokens" int64. Keys not listed keep the list's kind.
KEY_DTYPES = {
    "target_tokens": "int64", "weights": "float32", "advantages": "float32", "logprobs": "float32",
    "clip_low_threshold": "float32", "clip_high_threshold": "float32", "sequence_ratio_mask": "float32",
}


def as_tensor_data(value: Any, key: str | None = None) -> TensorData:
    """``value`` (TensorData, numpy, torch, or a list) as TensorData, in the dtype Tinker gives ``key``.
    Unlike the SDK, numpy and torch values of a float key are made float too (int weights would be
    refused by the server anyway)."""
    want = KEY_DTYPES.get(key or "")
    if isinstance(value, TensorData):
        return value
    if isinstance(value, np.ndarray):
        arr = value
    elif type(value).__module__.startswith("torch"):
        arr = value.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(value)
        except ValueError as exc:
            raise ValueError(f"{key} must be a rectangular numeric array; ragged nested lists are not supported") from exc
        if arr.dtype.kind not in "fiub":
            raise TypeError(f"Unsupported loss_fn_inputs value for {key!r}: {type(value).__name__}")
        if want is None:
            want = "float32" if arr.dtype.kind == "f" else "int64"
    if want == "float32" and arr.dtype.kind != "f":
        arr = arr.astype(np.float32)
    elif want == "int64" and arr.dtype.kind != "i":
        arr = arr.astype(np.int64)
    elif want is not None and arr.dtype != np.dtype(want):
        arr = arr.astype(want)
    return TensorData.from_numpy(arr)


@dataclass
class EncodedTextChunk:
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


ModelInputChunk = EncodedTextChunk | ImageChunk | ImageAssetPointerChunk


@dataclass
class ModelInput:
    chunks: list[ModelInputChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        """The tokens; a ValueError when the input has images (they are not tokens until the server expands them)."""
        if not all(isinstance(chunk, EncodedTextChunk) for chunk in self.chunks):
            raise ValueError(f"to_ints only supported for ModelInput with EncodedTextChunks, got "
                             f"{[type(chunk).__name__ for chunk in self.chunks]}")
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        """The context the input takes: its tokens, and each image's expected_tokens (a ValueError when unset)."""
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: ModelInputChunk) -> "ModelInput":
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> "ModelInput":
        return self.append(EncodedTextChunk(tokens=[int(token)]))


@dataclass
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    def __post_init__(self):
        self.loss_fn_inputs = {k: as_tensor_data(v, k) for k, v in self.loss_fn_inputs.items()}


@dataclass
class SamplingParams:
    """``stop``: None keeps the model's end-of-sequence stop; [] disables stopping; else strings or ids.

    temperature 0 is greedy. By default returned logprobs are log p(token) under the raw model
    (temperature 1, full vocabulary), the quantity the trainer's losses compare against;
    ``processed_logprobs=True`` returns them under the distribution actually sampled from (after
    temperature, top-k and top-p).
    """

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    processed_logprobs: bool = False


@dataclass
class LoraConfig:
    rank: int = 32
    alpha: float | None = None   # None: the server default (32)
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    dropout: float = 0.0
    # Mixture-of-experts models: each routed expert's LoRA rank (train_mlp adapts every routed expert).
    # Asked for: 0 is the server's default, rank // num_experts_per_tok. In a run's info: the rank in
    # effect, 0 when no routed expert is adapted (a dense model, or no train_mlp).
    expert_rank: int = 0


@dataclass
class ForwardBackwardOutput:
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


@dataclass
class OptimStepResponse:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SampledSequence:
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    topk_logprobs: list[list[tuple[int, float]]] | None = None  # per position: (token, logprob), raw model
    sequence_id: str = ""  # stable per sampled sequence, "<sampler_id>:<request_tag>:<i>" (Tinker's field)
    versions: list[VersionSpan] = field(default_factory=list)  # the weights of each token, in order (docs/async_rl.md)


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    # per prompt position, the k most likely (token, logprob) pairs; None where not scored (position 0,
    # before prompt_logprobs_last_n)
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # leading prompt tokens the sampler reused from this sampling client's earlier requests (Tinker's field)
    prompt_cache_hit_tokens: int = 0


@dataclass
class Checkpoint:
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    training_run_id: str
    size_bytes: int | None = None
    public: bool = False                # published: readable by other tenants (Tinker's name)
    expires_at: datetime | None = None  # deleted then (a TTL); None: kept until deleted
    user_metadata: dict[str, str] | None = None  # as given to save_state / save_weights_for_sampler
    base_model: str | None = None                # the base model of its run (Tinker 0.39's field)


@dataclass
class SaveWeightsResponse:
    path: str
    checkpoint: Checkpoint | None = None


@dataclass
class SaveWeightsForSamplerResponse:
    path: str
    checkpoint: Checkpoint | None = None


@dataclass
class ImportCheckpointResponse:
    """An imported adapter: ``path`` (sampler checkpoint) samples it, ``state_path`` (with save_state)
    loads it into a run; both belong to the new run ``training_run_id``."""
    path: str
    training_run_id: str
    state_path: str | None = None
    checkpoint: Checkpoint | None = None
    state_checkpoint: Checkpoint | None = None


@dataclass
class LoadWeightsResponse:
    path: str


@dataclass
class ModelData:
    model_name: str
    tokenizer_id: str
    arch: str | None = None


@dataclass
class GetInfoResponse:
    model_id: str
    model_data: ModelData
    lora_rank: int
    lora_config: LoraConfig
    next_seq_id: int
    vocab_size: int
    max_context_length: int
    is_lora: bool = True
    deterministic: bool = False  # the run's deterministic mode (docs/deterministic.md); Temper's, not Tinker's

    @property
    def model_name(self) -> str:
        return self.model_data.model_name

    @property
    def expert_rank(self) -> int:
        """The routed experts' LoRA rank in effect (mixture-of-experts models); 0: no expert LoRA."""
        return self.lora_config.expert_rank


@dataclass
class SupportedModel:
    model_name: str
    max_context_length: int
    trainable: bool
    sampleable: bool
    family: str = ""               # e.g. "llama", "qwen3_moe" (as its trainers report it; "" if unknown)
    num_experts: int = 0           # routed experts per MoE layer; 0: a dense model
    num_experts_per_tok: int = 0   # experts a token is routed to; 0: a dense model
    vision: VisionInfo | None = None  # set for a vision-language model; None: text only


@dataclass
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel]


def metrics_dict(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


# the RestClient's types live in rest_types.py; tinker.types holds them in the same namespace as the rest
from temper.client.rest_types import (  # noqa: E402,F401
    Cursor,
    CheckpointsListResponse,
    OwnSearchOwner,
    AccessibleSearchOwner,
    UserSearchOwner,
    SearchOwner,
    CheckpointSearchCursor,
    CheckpointSearchRequest,
    CheckpointSearchResponse,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
    GetSamplerResponse,
    ParsedCheckpointTinkerPath,
)
