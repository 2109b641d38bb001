"""The Temper client: Tinker-shaped ServiceClient / TrainingClient / SamplingClient / RestClient over gRPC.

A Tinker script runs on it by changing its imports (``import temper.client as tinker``, ``from
temper.client import types``). Imports only grpc, protobuf and numpy (no torch, transformers or
SQLAlchemy); get_tokenizer and forward_backward_custom import transformers / torch when called.
"""

from temper.client import types
from temper.client.errors import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    BillingError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestFailedError,
    TinkerError,
    UnprocessableEntityError,
    UnsupportedError,
)
from temper.client.futures import APIFuture, ClientFuture
from temper.client.rest_client import RestClient
from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient
from temper.client.types import (
    AdamOptimizerConfig,
    AdamParams,
    Checkpoint,
    CheckpointType,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageAsset,
    ImageAssetPointerChunk,
    ImageChunk,
    LoraConfig,
    ModelID,
    ModelInput,
    ModelInputChunk,
    OptimParams,
    OptimStepResponse,
    ParsedCheckpointTinkerPath,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    TensorData,
    TensorDtype,
    TrainingRun,
)
from temper.client.versions import VersionSpan, WeightsVersion
from temper.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TemperError,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "APIConnectionError", "APIError", "APIFuture", "APIResponseValidationError", "APIStatusError", "APITimeoutError",
    "AdamOptimizerConfig", "AdamParams", "AlreadyExists", "AuthenticationError", "BadRequestError", "BillingError",
    "Checkpoint", "CheckpointType", "ClientFuture", "ConflictError", "Datum", "EncodedTextChunk", "FailedPrecondition",
    "ForwardBackwardOutput", "ImageAsset", "ImageAssetPointerChunk", "ImageChunk", "InternalServerError",
    "InvalidArgument", "LoraConfig", "ModelID", "ModelInput",
    "ModelInputChunk", "NotFound", "NotFoundError", "OptimParams", "OptimStepResponse", "ParsedCheckpointTinkerPath",
    "PermissionDeniedError", "RateLimitError", "RequestFailedError", "ResourceExhausted", "RestClient",
    "SampleResponse", "SampledSequence", "SamplingClient", "SamplingParams", "ServiceClient", "StopReason",
    "TemperError", "TensorData", "TensorDtype", "TinkerError", "TrainingClient", "TrainingRun", "Unauthenticated",
    "Unavailable", "VersionSpan", "WeightsVersion", "UnprocessableEntityError", "UnsupportedError", "types",
]
