"""The Temper client: Tinker-shaped ServiceClient / TrainingClient / SamplingClient over gRPC.

Imports only grpc, protobuf and numpy (no torch, transformers or SQLAlchemy).
"""

from temper.client import types
from temper.client.futures import APIFuture
from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient
from temper.client.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    LoraConfig,
    ModelInput,
    SamplingParams,
    TensorData,
)
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
    "APIFuture", "AdamParams", "AlreadyExists", "Datum", "EncodedTextChunk", "FailedPrecondition", "InvalidArgument",
    "LoraConfig", "ModelInput", "NotFound", "ResourceExhausted", "SamplingClient", "SamplingParams", "ServiceClient",
    "TemperError", "TensorData", "TrainingClient", "Unauthenticated", "Unavailable", "types",
]
