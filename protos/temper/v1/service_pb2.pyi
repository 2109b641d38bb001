from temper.v1 import records_pb2 as _records_pb2
from temper.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetServerCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SupportedModel(_message.Message):
    __slots__ = ("model_name", "max_context_length", "trainable", "sampleable", "family", "num_experts", "num_experts_per_tok", "vision")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLEABLE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_context_length: int
    trainable: bool
    sampleable: bool
    family: str
    num_experts: int
    num_experts_per_tok: int
    vision: _types_pb2.VisionInfo
    def __init__(self, model_name: _Optional[str] = ..., max_context_length: _Optional[int] = ..., trainable: _Optional[bool] = ..., sampleable: _Optional[bool] = ..., family: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., vision: _Optional[_Union[_types_pb2.VisionInfo, _Mapping]] = ...) -> None: ...

class GetServerCapabilitiesResponse(_message.Message):
    __slots__ = ("supported_models",)
    SUPPORTED_MODELS_FIELD_NUMBER: _ClassVar[int]
    supported_models: _containers.RepeatedCompositeFieldContainer[SupportedModel]
    def __init__(self, supported_models: _Optional[_Iterable[_Union[SupportedModel, _Mapping]]] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("tags", "user_metadata", "display_name", "project_id")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAGS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    display_name: str
    project_id: str
    def __init__(self, tags: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., display_name: _Optional[str] = ..., project_id: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "status")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: str
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateTrainingRunRequest(_message.Message):
    __slots__ = ("session_id", "base_model", "lora_config", "user_metadata", "from_path", "with_optimizer", "run_index", "deterministic")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    FROM_PATH_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    RUN_INDEX_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_model: str
    lora_config: _types_pb2.LoraConfig
    user_metadata: _containers.ScalarMap[str, str]
    from_path: str
    with_optimizer: bool
    run_index: int
    deterministic: bool
    def __init__(self, session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., lora_config: _Optional[_Union[_types_pb2.LoraConfig, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., from_path: _Optional[str] = ..., with_optimizer: _Optional[bool] = ..., run_index: _Optional[int] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class TrainingRunInfo(_message.Message):
    __slots__ = ("training_run_id", "base_model", "tokenizer_id", "lora_config", "next_seq_id", "vocab_size", "max_context_length", "user_metadata", "owner", "created_unix_ms", "last_request_unix_ms", "deterministic", "inflight", "family", "num_experts", "num_experts_per_tok")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    base_model: str
    tokenizer_id: str
    lora_config: _types_pb2.LoraConfig
    next_seq_id: int
    vocab_size: int
    max_context_length: int
    user_metadata: _containers.ScalarMap[str, str]
    owner: str
    created_unix_ms: int
    last_request_unix_ms: int
    deterministic: bool
    inflight: _types_pb2.WeightsVersion
    family: str
    num_experts: int
    num_experts_per_tok: int
    def __init__(self, training_run_id: _Optional[str] = ..., base_model: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., lora_config: _Optional[_Union[_types_pb2.LoraConfig, _Mapping]] = ..., next_seq_id: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., owner: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., last_request_unix_ms: _Optional[int] = ..., deterministic: _Optional[bool] = ..., inflight: _Optional[_Union[_types_pb2.WeightsVersion, _Mapping]] = ..., family: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("training_run_id",)
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    def __init__(self, training_run_id: _Optional[str] = ...) -> None: ...

class ListTrainingRunsRequest(_message.Message):
    __slots__ = ("limit", "offset", "project_id")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    limit: int
    offset: int
    project_id: str
    def __init__(self, limit: _Optional[int] = ..., offset: _Optional[int] = ..., project_id: _Optional[str] = ...) -> None: ...

class ListTrainingRunsResponse(_message.Message):
    __slots__ = ("training_runs", "total_count")
    TRAINING_RUNS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    training_runs: _containers.RepeatedCompositeFieldContainer[TrainingRunInfo]
    total_count: int
    def __init__(self, training_runs: _Optional[_Iterable[_Union[TrainingRunInfo, _Mapping]]] = ..., total_count: _Optional[int] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("training_run_id", "seq_id", "data", "loss_fn", "loss_fn_config", "forward_only")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _types_pb2.LossConfigValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_types_pb2.LossConfigValue, _Mapping]] = ...) -> None: ...
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    seq_id: int
    data: _containers.RepeatedCompositeFieldContainer[_types_pb2.Datum]
    loss_fn: str
    loss_fn_config: _containers.MessageMap[str, _types_pb2.LossConfigValue]
    forward_only: bool
    def __init__(self, training_run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., data: _Optional[_Iterable[_Union[_types_pb2.Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, _types_pb2.LossConfigValue]] = ..., forward_only: _Optional[bool] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("training_run_id", "seq_id", "adam_params")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    seq_id: int
    adam_params: _types_pb2.AdamParams
    def __init__(self, training_run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., adam_params: _Optional[_Union[_types_pb2.AdamParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveWeightsRequest(_message.Message):
    __slots__ = ("training_run_id", "seq_id", "name", "kind", "ttl_seconds", "ephemeral", "overwrite", "user_metadata", "inflight")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    seq_id: int
    name: str
    kind: _types_pb2.CheckpointKind
    ttl_seconds: int
    ephemeral: bool
    overwrite: bool
    user_metadata: _containers.ScalarMap[str, str]
    inflight: bool
    def __init__(self, training_run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., name: _Optional[str] = ..., kind: _Optional[_Union[_types_pb2.CheckpointKind, str]] = ..., ttl_seconds: _Optional[int] = ..., ephemeral: _Optional[bool] = ..., overwrite: _Optional[bool] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., inflight: _Optional[bool] = ...) -> None: ...

class SaveWeightsResponse(_message.Message):
    __slots__ = ("checkpoint", "weights")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    checkpoint: _types_pb2.Checkpoint
    weights: _types_pb2.WeightsVersion
    def __init__(self, checkpoint: _Optional[_Union[_types_pb2.Checkpoint, _Mapping]] = ..., weights: _Optional[_Union[_types_pb2.WeightsVersion, _Mapping]] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("training_run_id", "seq_id", "path", "with_optimizer")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    seq_id: int
    path: str
    with_optimizer: bool
    def __init__(self, training_run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., path: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class GetRequestResultRequest(_message.Message):
    __slots__ = ("training_run_id", "seq_id")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    seq_id: int
    def __init__(self, training_run_id: _Optional[str] = ..., seq_id: _Optional[int] = ...) -> None: ...

class AbandonSeqRequest(_message.Message):
    __slots__ = ("training_run_id", "seq_id")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    seq_id: int
    def __init__(self, training_run_id: _Optional[str] = ..., seq_id: _Optional[int] = ...) -> None: ...

class AbandonSeqResponse(_message.Message):
    __slots__ = ("skipped",)
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    skipped: bool
    def __init__(self, skipped: _Optional[bool] = ...) -> None: ...

class RequestResult(_message.Message):
    __slots__ = ("kind", "done", "forward_backward", "optim_step", "save_weights", "load_weights")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    done: bool
    forward_backward: _types_pb2.ForwardBackwardOutput
    optim_step: OptimStepResponse
    save_weights: SaveWeightsResponse
    load_weights: LoadWeightsResponse
    def __init__(self, kind: _Optional[str] = ..., done: _Optional[bool] = ..., forward_backward: _Optional[_Union[_types_pb2.ForwardBackwardOutput, _Mapping]] = ..., optim_step: _Optional[_Union[OptimStepResponse, _Mapping]] = ..., save_weights: _Optional[_Union[SaveWeightsResponse, _Mapping]] = ..., load_weights: _Optional[_Union[LoadWeightsResponse, _Mapping]] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CreateSamplingClientRequest(_message.Message):
    __slots__ = ("session_id", "base_model", "model_path", "inflight_training_run_id", "deterministic")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_model: str
    model_path: str
    inflight_training_run_id: str
    deterministic: bool
    def __init__(self, session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., model_path: _Optional[str] = ..., inflight_training_run_id: _Optional[str] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class SamplingClientInfo(_message.Message):
    __slots__ = ("sampler_id", "base_model", "model_path", "tokenizer_id", "vocab_size", "deterministic", "inflight_training_run_id", "min_version")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    base_model: str
    model_path: str
    tokenizer_id: str
    vocab_size: int
    deterministic: bool
    inflight_training_run_id: str
    min_version: int
    def __init__(self, sampler_id: _Optional[str] = ..., base_model: _Optional[str] = ..., model_path: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., deterministic: _Optional[bool] = ..., inflight_training_run_id: _Optional[str] = ..., min_version: _Optional[int] = ...) -> None: ...

class GetSamplingClientRequest(_message.Message):
    __slots__ = ("sampler_id",)
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    def __init__(self, sampler_id: _Optional[str] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("sampler_id", "prompt", "num_samples", "sampling_params", "include_prompt_logprobs", "topk_logprobs", "topk_prompt_logprobs", "prompt_logprobs_last_n", "record_stability_info", "request_tag", "pin_version")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    RECORD_STABILITY_INFO_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TAG_FIELD_NUMBER: _ClassVar[int]
    PIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    prompt: _types_pb2.ModelInput
    num_samples: int
    sampling_params: _types_pb2.SamplingParams
    include_prompt_logprobs: bool
    topk_logprobs: int
    topk_prompt_logprobs: int
    prompt_logprobs_last_n: int
    record_stability_info: bool
    request_tag: str
    pin_version: bool
    def __init__(self, sampler_id: _Optional[str] = ..., prompt: _Optional[_Union[_types_pb2.ModelInput, _Mapping]] = ..., num_samples: _Optional[int] = ..., sampling_params: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., include_prompt_logprobs: _Optional[bool] = ..., topk_logprobs: _Optional[int] = ..., topk_prompt_logprobs: _Optional[int] = ..., prompt_logprobs_last_n: _Optional[int] = ..., record_stability_info: _Optional[bool] = ..., request_tag: _Optional[str] = ..., pin_version: _Optional[bool] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("sampler_id", "prompt", "prompt_logprobs_last_n")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    prompt: _types_pb2.ModelInput
    prompt_logprobs_last_n: int
    def __init__(self, sampler_id: _Optional[str] = ..., prompt: _Optional[_Union[_types_pb2.ModelInput, _Mapping]] = ..., prompt_logprobs_last_n: _Optional[int] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("logprobs", "weights")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _types_pb2.Tensor
    weights: _types_pb2.WeightsVersion
    def __init__(self, logprobs: _Optional[_Union[_types_pb2.Tensor, _Mapping]] = ..., weights: _Optional[_Union[_types_pb2.WeightsVersion, _Mapping]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("training_run_id", "project_ids", "include_temporary")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEMPORARY_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    project_ids: _containers.RepeatedScalarFieldContainer[str]
    include_temporary: bool
    def __init__(self, training_run_id: _Optional[str] = ..., project_ids: _Optional[_Iterable[str]] = ..., include_temporary: _Optional[bool] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[_types_pb2.Checkpoint]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[_types_pb2.Checkpoint, _Mapping]]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SignCheckpointDownloadRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SignedCheckpointFile(_message.Message):
    __slots__ = ("relative_path", "token")
    RELATIVE_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    relative_path: str
    token: str
    def __init__(self, relative_path: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class SignCheckpointDownloadResponse(_message.Message):
    __slots__ = ("files", "expires_unix_ms")
    FILES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[SignedCheckpointFile]
    expires_unix_ms: int
    def __init__(self, files: _Optional[_Iterable[_Union[SignedCheckpointFile, _Mapping]]] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class ReadSignedCheckpointFileRequest(_message.Message):
    __slots__ = ("path", "relative_path", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    relative_path: str
    token: str
    def __init__(self, path: _Optional[str] = ..., relative_path: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class ImportCheckpointHeader(_message.Message):
    __slots__ = ("session_id", "name", "save_state", "user_metadata")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAVE_STATE_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    save_state: bool
    user_metadata: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., save_state: _Optional[bool] = ..., user_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ImportCheckpointChunk(_message.Message):
    __slots__ = ("header", "file")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    header: ImportCheckpointHeader
    file: _types_pb2.FileChunk
    def __init__(self, header: _Optional[_Union[ImportCheckpointHeader, _Mapping]] = ..., file: _Optional[_Union[_types_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class ImportCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint", "state_checkpoint", "training_run")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    checkpoint: _types_pb2.Checkpoint
    state_checkpoint: _types_pb2.Checkpoint
    training_run: TrainingRunInfo
    def __init__(self, checkpoint: _Optional[_Union[_types_pb2.Checkpoint, _Mapping]] = ..., state_checkpoint: _Optional[_Union[_types_pb2.Checkpoint, _Mapping]] = ..., training_run: _Optional[_Union[TrainingRunInfo, _Mapping]] = ...) -> None: ...

class UpdateCheckpointRequest(_message.Message):
    __slots__ = ("path", "published", "ttl_seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    published: bool
    ttl_seconds: int
    def __init__(self, path: _Optional[str] = ..., published: _Optional[bool] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class DeleteCheckpointResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunUsage(_message.Message):
    __slots__ = ("training_run_id", "tokens_trained", "steps")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    tokens_trained: int
    steps: int
    def __init__(self, training_run_id: _Optional[str] = ..., tokens_trained: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class SamplerUsage(_message.Message):
    __slots__ = ("sampler_id", "tokens_sampled")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    tokens_sampled: int
    def __init__(self, sampler_id: _Optional[str] = ..., tokens_sampled: _Optional[int] = ...) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("tenant", "weight", "tokens_trained", "tokens_sampled", "steps", "runs", "samplers", "storage_bytes", "limits", "image_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    tokens_trained: int
    tokens_sampled: int
    steps: int
    runs: _containers.RepeatedCompositeFieldContainer[RunUsage]
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerUsage]
    storage_bytes: int
    limits: _containers.RepeatedCompositeFieldContainer[LimitUsage]
    image_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., tokens_trained: _Optional[int] = ..., tokens_sampled: _Optional[int] = ..., steps: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[RunUsage, _Mapping]]] = ..., samplers: _Optional[_Iterable[_Union[SamplerUsage, _Mapping]]] = ..., storage_bytes: _Optional[int] = ..., limits: _Optional[_Iterable[_Union[LimitUsage, _Mapping]]] = ..., image_bytes: _Optional[int] = ...) -> None: ...

class LimitUsage(_message.Message):
    __slots__ = ("name", "limit", "used", "wait_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    limit: int
    used: float
    wait_seconds: float
    def __init__(self, name: _Optional[str] = ..., limit: _Optional[int] = ..., used: _Optional[float] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class UploadImageHeader(_message.Message):
    __slots__ = ("format", "base_model")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    format: str
    base_model: str
    def __init__(self, format: _Optional[str] = ..., base_model: _Optional[str] = ...) -> None: ...

class UploadImageChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UploadImageHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UploadImageHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImageAsset(_message.Message):
    __slots__ = ("location", "format", "width", "height", "size_bytes", "created_unix_ms", "created", "expected_tokens")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    location: str
    format: str
    width: int
    height: int
    size_bytes: int
    created_unix_ms: int
    created: bool
    expected_tokens: int
    def __init__(self, location: _Optional[str] = ..., format: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., size_bytes: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., created: _Optional[bool] = ..., expected_tokens: _Optional[int] = ...) -> None: ...

class ListImagesRequest(_message.Message):
    __slots__ = ("limit", "offset")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    limit: int
    offset: int
    def __init__(self, limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListImagesResponse(_message.Message):
    __slots__ = ("images", "total")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageAsset]
    total: int
    def __init__(self, images: _Optional[_Iterable[_Union[ImageAsset, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class DeleteImageRequest(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: str
    def __init__(self, location: _Optional[str] = ...) -> None: ...

class DeleteImageResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ("base_model",)
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    def __init__(self, base_model: _Optional[str] = ...) -> None: ...

class GetAuditLogRequest(_message.Message):
    __slots__ = ("from_unix_ms", "to_unix_ms", "page_size", "page_token", "tenant", "action")
    FROM_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TO_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    from_unix_ms: int
    to_unix_ms: int
    page_size: int
    page_token: str
    tenant: str
    action: str
    def __init__(self, from_unix_ms: _Optional[int] = ..., to_unix_ms: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., tenant: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("id", "at_unix_ms", "tenant", "key_prefix", "actor", "action", "target", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    id: int
    at_unix_ms: int
    tenant: str
    key_prefix: str
    actor: str
    action: str
    target: str
    details: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., at_unix_ms: _Optional[int] = ..., tenant: _Optional[str] = ..., key_prefix: _Optional[str] = ..., actor: _Optional[str] = ..., action: _Optional[str] = ..., target: _Optional[str] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetAuditLogResponse(_message.Message):
    __slots__ = ("entries", "next_page_token")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    next_page_token: str
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ApiKeyInfo(_message.Message):
    __slots__ = ("id", "prefix", "tenant", "label", "is_admin", "created_unix_ms", "last_used_unix_ms", "revoked_unix_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    id: int
    prefix: str
    tenant: str
    label: str
    is_admin: bool
    created_unix_ms: int
    last_used_unix_ms: int
    revoked_unix_ms: int
    def __init__(self, id: _Optional[int] = ..., prefix: _Optional[str] = ..., tenant: _Optional[str] = ..., label: _Optional[str] = ..., is_admin: _Optional[bool] = ..., created_unix_ms: _Optional[int] = ..., last_used_unix_ms: _Optional[int] = ..., revoked_unix_ms: _Optional[int] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("keys", "caller")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKeyInfo]
    caller: ApiKeyInfo
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKeyInfo, _Mapping]]] = ..., caller: _Optional[_Union[ApiKeyInfo, _Mapping]] = ...) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("label", "is_admin")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    label: str
    is_admin: bool
    def __init__(self, label: _Optional[str] = ..., is_admin: _Optional[bool] = ...) -> None: ...

class CreateApiKeyResponse(_message.Message):
    __slots__ = ("api_key", "key")
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    key: ApiKeyInfo
    def __init__(self, api_key: _Optional[str] = ..., key: _Optional[_Union[ApiKeyInfo, _Mapping]] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("role", "address", "base_model", "state", "incarnation", "runs_placed", "memory_used_bytes", "memory_capacity_bytes", "seconds_since_heard", "device")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RUNS_PLACED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    base_model: str
    state: str
    incarnation: str
    runs_placed: int
    memory_used_bytes: int
    memory_capacity_bytes: int
    seconds_since_heard: float
    device: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., base_model: _Optional[str] = ..., state: _Optional[str] = ..., incarnation: _Optional[str] = ..., runs_placed: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_capacity_bytes: _Optional[int] = ..., seconds_since_heard: _Optional[float] = ..., device: _Optional[str] = ...) -> None: ...

class LaneStatus(_message.Message):
    __slots__ = ("trainer_address", "queue_depth", "cycles_per_minute", "cycles_total")
    TRAINER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CYCLES_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    CYCLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    trainer_address: str
    queue_depth: int
    cycles_per_minute: float
    cycles_total: int
    def __init__(self, trainer_address: _Optional[str] = ..., queue_depth: _Optional[int] = ..., cycles_per_minute: _Optional[float] = ..., cycles_total: _Optional[int] = ...) -> None: ...

class TenantShare(_message.Message):
    __slots__ = ("tenant", "weight", "share", "queued_requests", "train_tokens_last_minute")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_TOKENS_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    share: float
    queued_requests: int
    train_tokens_last_minute: float
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., share: _Optional[float] = ..., queued_requests: _Optional[int] = ..., train_tokens_last_minute: _Optional[float] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("at_unix_ms", "kind", "what", "worker", "training_run_id")
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    at_unix_ms: int
    kind: str
    what: str
    worker: str
    training_run_id: str
    def __init__(self, at_unix_ms: _Optional[int] = ..., kind: _Optional[str] = ..., what: _Optional[str] = ..., worker: _Optional[str] = ..., training_run_id: _Optional[str] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("at_unix_ms", "workers", "lanes", "fair_share", "events", "replicated", "replicas", "free_lanes")
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FREE_LANES_FIELD_NUMBER: _ClassVar[int]
    at_unix_ms: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    lanes: _containers.RepeatedCompositeFieldContainer[LaneStatus]
    fair_share: _containers.RepeatedCompositeFieldContainer[TenantShare]
    events: _containers.RepeatedCompositeFieldContainer[ClusterEvent]
    replicated: bool
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    free_lanes: _containers.RepeatedCompositeFieldContainer[ReplicaLane]
    def __init__(self, at_unix_ms: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., lanes: _Optional[_Iterable[_Union[LaneStatus, _Mapping]]] = ..., fair_share: _Optional[_Iterable[_Union[TenantShare, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[ClusterEvent, _Mapping]]] = ..., replicated: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., free_lanes: _Optional[_Iterable[_Union[ReplicaLane, _Mapping]]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("owner", "address", "live", "seconds_since_heard", "started_at_unix_ms", "answering", "lanes")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARD_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ANSWERING_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    owner: str
    address: str
    live: bool
    seconds_since_heard: float
    started_at_unix_ms: int
    answering: bool
    lanes: _containers.RepeatedCompositeFieldContainer[ReplicaLane]
    def __init__(self, owner: _Optional[str] = ..., address: _Optional[str] = ..., live: _Optional[bool] = ..., seconds_since_heard: _Optional[float] = ..., started_at_unix_ms: _Optional[int] = ..., answering: _Optional[bool] = ..., lanes: _Optional[_Iterable[_Union[ReplicaLane, _Mapping]]] = ...) -> None: ...

class ReplicaLane(_message.Message):
    __slots__ = ("trainer_address", "token", "live", "lease_age_seconds", "seconds_left")
    TRAINER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    trainer_address: str
    token: int
    live: bool
    lease_age_seconds: float
    seconds_left: float
    def __init__(self, trainer_address: _Optional[str] = ..., token: _Optional[int] = ..., live: _Optional[bool] = ..., lease_age_seconds: _Optional[float] = ..., seconds_left: _Optional[float] = ...) -> None: ...

class GetBillingUsageRequest(_message.Message):
    __slots__ = ("from_unix_ms", "to_unix_ms")
    FROM_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TO_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    from_unix_ms: int
    to_unix_ms: int
    def __init__(self, from_unix_ms: _Optional[int] = ..., to_unix_ms: _Optional[int] = ...) -> None: ...

class BillingBucket(_message.Message):
    __slots__ = ("bucket_start_unix_ms", "base_model", "session_id", "kind", "token_count", "count", "gigabyte_hours")
    BUCKET_START_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GIGABYTE_HOURS_FIELD_NUMBER: _ClassVar[int]
    bucket_start_unix_ms: int
    base_model: str
    session_id: str
    kind: str
    token_count: int
    count: int
    gigabyte_hours: float
    def __init__(self, bucket_start_unix_ms: _Optional[int] = ..., base_model: _Optional[str] = ..., session_id: _Optional[str] = ..., kind: _Optional[str] = ..., token_count: _Optional[int] = ..., count: _Optional[int] = ..., gigabyte_hours: _Optional[float] = ...) -> None: ...

class GetBillingUsageResponse(_message.Message):
    __slots__ = ("buckets",)
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[BillingBucket]
    def __init__(self, buckets: _Optional[_Iterable[_Union[BillingBucket, _Mapping]]] = ...) -> None: ...

class CopyCheckpointRequest(_message.Message):
    __slots__ = ("source_path", "ttl_seconds", "session_id", "project_id")
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    source_path: str
    ttl_seconds: int
    session_id: str
    project_id: str
    def __init__(self, source_path: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., session_id: _Optional[str] = ..., project_id: _Optional[str] = ...) -> None: ...

class CreateAuthTokenRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AuthToken(_message.Message):
    __slots__ = ("jwt", "expires_unix_ms")
    JWT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    jwt: str
    expires_unix_ms: int
    def __init__(self, jwt: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...
