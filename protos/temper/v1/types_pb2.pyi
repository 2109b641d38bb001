from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_STOP: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]

class CheckpointKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_KIND_UNSPECIFIED: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_SAMPLER: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_TRAINING: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_EXTERNAL: _ClassVar[CheckpointKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_STOP: StopReason
STOP_REASON_LENGTH: StopReason
CHECKPOINT_KIND_UNSPECIFIED: CheckpointKind
CHECKPOINT_KIND_SAMPLER: CheckpointKind
CHECKPOINT_KIND_TRAINING: CheckpointKind
CHECKPOINT_KIND_EXTERNAL: CheckpointKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EncodedTextChunk(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    def __init__(self, tokens: _Optional[bytes] = ...) -> None: ...

class ImageChunk(_message.Message):
    __slots__ = ("data", "format", "expected_tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    format: str
    expected_tokens: int
    def __init__(self, data: _Optional[bytes] = ..., format: _Optional[str] = ..., expected_tokens: _Optional[int] = ...) -> None: ...

class ImageAssetPointerChunk(_message.Message):
    __slots__ = ("location", "format", "expected_tokens")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    location: str
    format: str
    expected_tokens: int
    def __init__(self, location: _Optional[str] = ..., format: _Optional[str] = ..., expected_tokens: _Optional[int] = ...) -> None: ...

class DmelChunk(_message.Message):
    __slots__ = ("dmel",)
    DMEL_FIELD_NUMBER: _ClassVar[int]
    dmel: bytes
    def __init__(self, dmel: _Optional[bytes] = ...) -> None: ...

class ModelInputChunk(_message.Message):
    __slots__ = ("encoded_text", "image", "image_asset_pointer", "dmel")
    ENCODED_TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ASSET_POINTER_FIELD_NUMBER: _ClassVar[int]
    DMEL_FIELD_NUMBER: _ClassVar[int]
    encoded_text: EncodedTextChunk
    image: ImageChunk
    image_asset_pointer: ImageAssetPointerChunk
    dmel: DmelChunk
    def __init__(self, encoded_text: _Optional[_Union[EncodedTextChunk, _Mapping]] = ..., image: _Optional[_Union[ImageChunk, _Mapping]] = ..., image_asset_pointer: _Optional[_Union[ImageAssetPointerChunk, _Mapping]] = ..., dmel: _Optional[_Union[DmelChunk, _Mapping]] = ...) -> None: ...

class ModelInput(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ModelInputChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ModelInputChunk, _Mapping]]] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("model_input", "loss_fn_inputs")
    class LossFnInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    MODEL_INPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    model_input: ModelInput
    loss_fn_inputs: _containers.MessageMap[str, Tensor]
    def __init__(self, model_input: _Optional[_Union[ModelInput, _Mapping]] = ..., loss_fn_inputs: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class LossConfigValue(_message.Message):
    __slots__ = ("number", "text")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    number: float
    text: str
    def __init__(self, number: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class LossFnOutput(_message.Message):
    __slots__ = ("fields",)
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.MessageMap[str, Tensor]
    def __init__(self, fields: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class ForwardBackwardOutput(_message.Message):
    __slots__ = ("loss_fn_output_type", "loss_fn_outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FN_OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss_fn_output_type: str
    loss_fn_outputs: _containers.RepeatedCompositeFieldContainer[LossFnOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, loss_fn_output_type: _Optional[str] = ..., loss_fn_outputs: _Optional[_Iterable[_Union[LossFnOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("rank", "alpha", "seed", "train_attn", "train_mlp", "train_unembed", "dropout", "expert_rank", "train_vision")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RANK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_VISION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    seed: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    dropout: float
    expert_rank: int
    train_vision: bool
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., seed: _Optional[int] = ..., train_attn: _Optional[bool] = ..., train_mlp: _Optional[bool] = ..., train_unembed: _Optional[bool] = ..., dropout: _Optional[float] = ..., expert_rank: _Optional[int] = ..., train_vision: _Optional[bool] = ...) -> None: ...

class VisionInfo(_message.Message):
    __slots__ = ("image_token_id", "vision_start_token_id", "vision_end_token_id", "image_processor_json")
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VISION_START_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VISION_END_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PROCESSOR_JSON_FIELD_NUMBER: _ClassVar[int]
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    image_processor_json: str
    def __init__(self, image_token_id: _Optional[int] = ..., vision_start_token_id: _Optional[int] = ..., vision_end_token_id: _Optional[int] = ..., image_processor_json: _Optional[str] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "seed", "temperature", "top_k", "top_p", "stop_strings", "stop_token_ids", "stop_disabled", "processed_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_DISABLED_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: bytes
    stop_disabled: bool
    processed_logprobs: bool
    def __init__(self, max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[bytes] = ..., stop_disabled: _Optional[bool] = ..., processed_logprobs: _Optional[bool] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("stop_reason", "tokens", "logprobs", "topk", "topk_token_ids", "topk_logprobs", "sequence_id", "versions")
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    stop_reason: StopReason
    tokens: bytes
    logprobs: bytes
    topk: int
    topk_token_ids: bytes
    topk_logprobs: bytes
    sequence_id: str
    versions: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    def __init__(self, stop_reason: _Optional[_Union[StopReason, str]] = ..., tokens: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., topk: _Optional[int] = ..., topk_token_ids: _Optional[bytes] = ..., topk_logprobs: _Optional[bytes] = ..., sequence_id: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("sequences", "prompt_logprobs", "topk_prompt_token_ids", "topk_prompt_logprobs", "prompt_cache_hit_tokens")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: Tensor
    topk_prompt_token_ids: Tensor
    topk_prompt_logprobs: Tensor
    prompt_cache_hit_tokens: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., topk_prompt_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_prompt_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_cache_hit_tokens: _Optional[int] = ...) -> None: ...

class SampledPiece(_message.Message):
    __slots__ = ("index", "tokens", "logprobs", "topk", "topk_token_ids", "topk_logprobs", "stop_reason", "sequence_id", "versions")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    TOPK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    index: int
    tokens: bytes
    logprobs: bytes
    topk: int
    topk_token_ids: bytes
    topk_logprobs: bytes
    stop_reason: StopReason
    sequence_id: str
    versions: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    def __init__(self, index: _Optional[int] = ..., tokens: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., topk: _Optional[int] = ..., topk_token_ids: _Optional[bytes] = ..., topk_logprobs: _Optional[bytes] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., sequence_id: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ...) -> None: ...

class SampleStreamChunk(_message.Message):
    __slots__ = ("pieces", "done", "prompt_logprobs", "topk_prompt_token_ids", "topk_prompt_logprobs")
    PIECES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[SampledPiece]
    done: bool
    prompt_logprobs: Tensor
    topk_prompt_token_ids: Tensor
    topk_prompt_logprobs: Tensor
    def __init__(self, pieces: _Optional[_Iterable[_Union[SampledPiece, _Mapping]]] = ..., done: _Optional[bool] = ..., prompt_logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., topk_prompt_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_prompt_logprobs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class WeightsVersion(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("weights", "first_token", "count")
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    weights: WeightsVersion
    first_token: int
    count: int
    def __init__(self, weights: _Optional[_Union[WeightsVersion, _Mapping]] = ..., first_token: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("checkpoint_id", "kind", "path", "training_run_id", "size_bytes", "created_unix_ms", "published", "expires_unix_ms", "base_model", "lora_config", "user_metadata", "temporary")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    TEMPORARY_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    kind: CheckpointKind
    path: str
    training_run_id: str
    size_bytes: int
    created_unix_ms: int
    published: bool
    expires_unix_ms: int
    base_model: str
    lora_config: LoraConfig
    user_metadata: _containers.ScalarMap[str, str]
    temporary: bool
    def __init__(self, checkpoint_id: _Optional[str] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., path: _Optional[str] = ..., training_run_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., published: _Optional[bool] = ..., expires_unix_ms: _Optional[int] = ..., base_model: _Optional[str] = ..., lora_config: _Optional[_Union[LoraConfig, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., temporary: _Optional[bool] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("relative_path", "offset", "data", "total_size")
    RELATIVE_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    relative_path: str
    offset: int
    data: bytes
    total_size: int
    def __init__(self, relative_path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ...) -> None: ...
