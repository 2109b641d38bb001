from temper.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("base_model", "tokenizer_id", "vocab_size", "max_context_length", "device", "dtype", "incarnation", "family", "num_experts", "num_experts_per_tok", "world_size", "devices", "device_memory_bytes", "device_memory_used_bytes", "deterministic_unsupported", "vision")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    tokenizer_id: str
    vocab_size: int
    max_context_length: int
    device: str
    dtype: str
    incarnation: str
    family: str
    num_experts: int
    num_experts_per_tok: int
    world_size: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    device_memory_bytes: _containers.RepeatedScalarFieldContainer[int]
    device_memory_used_bytes: int
    deterministic_unsupported: str
    vision: _types_pb2.VisionInfo
    def __init__(self, base_model: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., incarnation: _Optional[str] = ..., family: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., world_size: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., device_memory_bytes: _Optional[_Iterable[int]] = ..., device_memory_used_bytes: _Optional[int] = ..., deterministic_unsupported: _Optional[str] = ..., vision: _Optional[_Union[_types_pb2.VisionInfo, _Mapping]] = ...) -> None: ...

class CreateAdapterRequest(_message.Message):
    __slots__ = ("training_run_id", "lora_config")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    lora_config: _types_pb2.LoraConfig
    def __init__(self, training_run_id: _Optional[str] = ..., lora_config: _Optional[_Union[_types_pb2.LoraConfig, _Mapping]] = ...) -> None: ...

class CreateAdapterResponse(_message.Message):
    __slots__ = ("expert_rank",)
    EXPERT_RANK_FIELD_NUMBER: _ClassVar[int]
    expert_rank: int
    def __init__(self, expert_rank: _Optional[int] = ...) -> None: ...

class DropAdapterRequest(_message.Message):
    __slots__ = ("training_run_id",)
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    def __init__(self, training_run_id: _Optional[str] = ...) -> None: ...

class DropAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForwardBackwardItem(_message.Message):
    __slots__ = ("training_run_id", "data", "loss_fn", "loss_fn_config", "forward_only", "seq_id", "deterministic")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _types_pb2.LossConfigValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_types_pb2.LossConfigValue, _Mapping]] = ...) -> None: ...
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    data: _containers.RepeatedCompositeFieldContainer[_types_pb2.Datum]
    loss_fn: str
    loss_fn_config: _containers.MessageMap[str, _types_pb2.LossConfigValue]
    forward_only: bool
    seq_id: int
    deterministic: bool
    def __init__(self, training_run_id: _Optional[str] = ..., data: _Optional[_Iterable[_Union[_types_pb2.Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, _types_pb2.LossConfigValue]] = ..., forward_only: _Optional[bool] = ..., seq_id: _Optional[int] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class OptimStepItem(_message.Message):
    __slots__ = ("training_run_id", "adam_params", "seq_id")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    adam_params: _types_pb2.AdamParams
    seq_id: int
    def __init__(self, training_run_id: _Optional[str] = ..., adam_params: _Optional[_Union[_types_pb2.AdamParams, _Mapping]] = ..., seq_id: _Optional[int] = ...) -> None: ...

class CycleRequest(_message.Message):
    __slots__ = ("forward_backward", "optim_step")
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    forward_backward: _containers.RepeatedCompositeFieldContainer[ForwardBackwardItem]
    optim_step: _containers.RepeatedCompositeFieldContainer[OptimStepItem]
    def __init__(self, forward_backward: _Optional[_Iterable[_Union[ForwardBackwardItem, _Mapping]]] = ..., optim_step: _Optional[_Iterable[_Union[OptimStepItem, _Mapping]]] = ...) -> None: ...

class CycleResponse(_message.Message):
    __slots__ = ("forward_backward", "optim_step", "forward_backward_status", "optim_step_status")
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_STATUS_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_STATUS_FIELD_NUMBER: _ClassVar[int]
    forward_backward: _containers.RepeatedCompositeFieldContainer[_types_pb2.ForwardBackwardOutput]
    optim_step: _containers.RepeatedCompositeFieldContainer[OptimStepResponseInternal]
    forward_backward_status: _containers.RepeatedCompositeFieldContainer[ItemStatus]
    optim_step_status: _containers.RepeatedCompositeFieldContainer[ItemStatus]
    def __init__(self, forward_backward: _Optional[_Iterable[_Union[_types_pb2.ForwardBackwardOutput, _Mapping]]] = ..., optim_step: _Optional[_Iterable[_Union[OptimStepResponseInternal, _Mapping]]] = ..., forward_backward_status: _Optional[_Iterable[_Union[ItemStatus, _Mapping]]] = ..., optim_step_status: _Optional[_Iterable[_Union[ItemStatus, _Mapping]]] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class OptimStepResponseInternal(_message.Message):
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

class SaveAdapterRequest(_message.Message):
    __slots__ = ("training_run_id", "checkpoint_key", "include_optimizer", "measure_only")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MEASURE_ONLY_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    checkpoint_key: str
    include_optimizer: bool
    measure_only: bool
    def __init__(self, training_run_id: _Optional[str] = ..., checkpoint_key: _Optional[str] = ..., include_optimizer: _Optional[bool] = ..., measure_only: _Optional[bool] = ...) -> None: ...

class SaveAdapterResponse(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("training_run_id", "checkpoint_key", "with_optimizer")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    checkpoint_key: str
    with_optimizer: bool
    def __init__(self, training_run_id: _Optional[str] = ..., checkpoint_key: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadCheckpointRequest(_message.Message):
    __slots__ = ("checkpoint_key", "weights_only", "relative_path")
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_PATH_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    weights_only: bool
    relative_path: str
    def __init__(self, checkpoint_key: _Optional[str] = ..., weights_only: _Optional[bool] = ..., relative_path: _Optional[str] = ...) -> None: ...

class DeleteCheckpointFilesRequest(_message.Message):
    __slots__ = ("checkpoint_key",)
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    def __init__(self, checkpoint_key: _Optional[str] = ...) -> None: ...

class DeleteCheckpointFilesResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class SnapshotAdapterRequest(_message.Message):
    __slots__ = ("training_run_id", "checkpoint_key")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    checkpoint_key: str
    def __init__(self, training_run_id: _Optional[str] = ..., checkpoint_key: _Optional[str] = ...) -> None: ...

class SnapshotAdapterResponse(_message.Message):
    __slots__ = ("size_bytes", "applied_seq_id", "steps")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    applied_seq_id: int
    steps: int
    def __init__(self, size_bytes: _Optional[int] = ..., applied_seq_id: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class RestoreAdapterRequest(_message.Message):
    __slots__ = ("training_run_id", "checkpoint_key")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    checkpoint_key: str
    def __init__(self, training_run_id: _Optional[str] = ..., checkpoint_key: _Optional[str] = ...) -> None: ...

class RestoreAdapterResponse(_message.Message):
    __slots__ = ("applied_seq_id", "steps")
    APPLIED_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    applied_seq_id: int
    steps: int
    def __init__(self, applied_seq_id: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class ReadTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImportAdapterChunk(_message.Message):
    __slots__ = ("checkpoint_key", "file")
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    file: _types_pb2.FileChunk
    def __init__(self, checkpoint_key: _Optional[str] = ..., file: _Optional[_Union[_types_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class ImportAdapterResponse(_message.Message):
    __slots__ = ("size_bytes", "lora_config")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    lora_config: _types_pb2.LoraConfig
    def __init__(self, size_bytes: _Optional[int] = ..., lora_config: _Optional[_Union[_types_pb2.LoraConfig, _Mapping]] = ...) -> None: ...

class CopyCheckpointFilesRequest(_message.Message):
    __slots__ = ("source_key", "checkpoint_key")
    SOURCE_KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    source_key: str
    checkpoint_key: str
    def __init__(self, source_key: _Optional[str] = ..., checkpoint_key: _Optional[str] = ...) -> None: ...

class CopyCheckpointFilesResponse(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...
