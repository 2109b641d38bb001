from temper.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetInflightTargetRequest(_message.Message):
    __slots__ = ("training_run_id", "checkpoint_key", "weights")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    checkpoint_key: str
    weights: _types_pb2.WeightsVersion
    def __init__(self, training_run_id: _Optional[str] = ..., checkpoint_key: _Optional[str] = ..., weights: _Optional[_Union[_types_pb2.WeightsVersion, _Mapping]] = ...) -> None: ...

class SetInflightTargetResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SamplerModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplerModelInfo(_message.Message):
    __slots__ = ("base_model", "tokenizer_id", "vocab_size", "max_context_length", "backend", "loaded_adapters", "incarnation", "deterministic_unsupported", "vision")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    tokenizer_id: str
    vocab_size: int
    max_context_length: int
    backend: str
    loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
    incarnation: str
    deterministic_unsupported: str
    vision: _types_pb2.VisionInfo
    def __init__(self, base_model: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., backend: _Optional[str] = ..., loaded_adapters: _Optional[_Iterable[str]] = ..., incarnation: _Optional[str] = ..., deterministic_unsupported: _Optional[str] = ..., vision: _Optional[_Union[_types_pb2.VisionInfo, _Mapping]] = ...) -> None: ...

class PushAdapterChunk(_message.Message):
    __slots__ = ("checkpoint_key", "file")
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    file: _types_pb2.FileChunk
    def __init__(self, checkpoint_key: _Optional[str] = ..., file: _Optional[_Union[_types_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class PushAdapterResponse(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class SamplerDropAdapterRequest(_message.Message):
    __slots__ = ("checkpoint_key",)
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    def __init__(self, checkpoint_key: _Optional[str] = ...) -> None: ...

class SamplerDropAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplerSampleRequest(_message.Message):
    __slots__ = ("checkpoint_key", "prompt_tokens", "num_samples", "sampling_params", "include_prompt_logprobs", "topk_logprobs", "topk_prompt_logprobs", "prompt_logprobs_last_n", "deterministic", "prompt", "sampling_session_id", "tenant", "weights", "inflight_run", "pin_version")
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_RUN_FIELD_NUMBER: _ClassVar[int]
    PIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    prompt_tokens: bytes
    num_samples: int
    sampling_params: _types_pb2.SamplingParams
    include_prompt_logprobs: bool
    topk_logprobs: int
    topk_prompt_logprobs: int
    prompt_logprobs_last_n: int
    deterministic: bool
    prompt: _types_pb2.ModelInput
    sampling_session_id: str
    tenant: str
    weights: _types_pb2.WeightsVersion
    inflight_run: str
    pin_version: bool
    def __init__(self, checkpoint_key: _Optional[str] = ..., prompt_tokens: _Optional[bytes] = ..., num_samples: _Optional[int] = ..., sampling_params: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., include_prompt_logprobs: _Optional[bool] = ..., topk_logprobs: _Optional[int] = ..., topk_prompt_logprobs: _Optional[int] = ..., prompt_logprobs_last_n: _Optional[int] = ..., deterministic: _Optional[bool] = ..., prompt: _Optional[_Union[_types_pb2.ModelInput, _Mapping]] = ..., sampling_session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., weights: _Optional[_Union[_types_pb2.WeightsVersion, _Mapping]] = ..., inflight_run: _Optional[str] = ..., pin_version: _Optional[bool] = ...) -> None: ...

class SamplerLogprobsRequest(_message.Message):
    __slots__ = ("checkpoint_key", "prompt_tokens", "prompt_logprobs_last_n", "deterministic", "prompt")
    CHECKPOINT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    checkpoint_key: str
    prompt_tokens: bytes
    prompt_logprobs_last_n: int
    deterministic: bool
    prompt: _types_pb2.ModelInput
    def __init__(self, checkpoint_key: _Optional[str] = ..., prompt_tokens: _Optional[bytes] = ..., prompt_logprobs_last_n: _Optional[int] = ..., deterministic: _Optional[bool] = ..., prompt: _Optional[_Union[_types_pb2.ModelInput, _Mapping]] = ...) -> None: ...

class ComputeLogprobsResponseInternal(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _types_pb2.Tensor
    def __init__(self, logprobs: _Optional[_Union[_types_pb2.Tensor, _Mapping]] = ...) -> None: ...
