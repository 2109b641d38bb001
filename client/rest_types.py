"""The RestClient's answers and requests (``tinker.types`` names and fields): runs, checkpoint lists,
checkpoint search, weights info. ``temper.client.types`` re-exports them, as ``tinker.types`` holds them
in one namespace."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Mapping

from temper.client.types import Checkpoint


@dataclass
class Cursor:
    offset: int
    limit: int
    total_count: int


@dataclass
class CheckpointsListResponse:
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


@dataclass(frozen=True)
class OwnSearchOwner:
    """The caller's own checkpoints (search_checkpoints' default)."""

    type: Literal["own"] = "own"


@dataclass(frozen=True)
class AccessibleSearchOwner:
    """Every checkpoint the caller may list: in Temper, the same as its own."""

    type: Literal["accessible"] = "accessible"


@dataclass(frozen=True)
class UserSearchOwner:
    """The listed owners' checkpoints: Temper's tenant names (TrainingRun.model_owner), 1 to 10."""

    owner_urns: list[str] = field(default_factory=list)
    type: Literal["user"] = "user"


SearchOwner = OwnSearchOwner | AccessibleSearchOwner | UserSearchOwner


@dataclass(frozen=True)
class CheckpointSearchCursor:
    """Where the next page starts; pass a response's ``next_cursor`` back unchanged."""

    last_created_at: datetime
    last_checkpoint_uuid: str  # in Temper: the last result's tinker path


@dataclass(frozen=True)
class CheckpointSearchRequest:
    """Tinker 0.39's checkpoint search (RestClient.search_checkpoints). ``project_ids``: any of these of
    the caller's projects (another's or an unknown one: NotFoundError); ``base_models``: any of them
    ([] matches none); ``limit``: 1 to 200."""

    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    checkpoint_type: CheckpointType | None = None
    owner: SearchOwner = field(default_factory=OwnSearchOwner)
    base_models: list[str] | None = None
    limit: int = 50
    cursor: CheckpointSearchCursor | None = None

    def model_copy(self, update: Mapping[str, Any] | None = None) -> "CheckpointSearchRequest":
        """As pydantic's (the SDK's paging loop calls ``request.model_copy(update={"cursor": ...})``)."""
        from dataclasses import replace

        return replace(self, **dict(update or {}))

    def to_json(self) -> dict[str, Any]:
        """The body the SDK sends (None fields left out)."""
        body: dict[str, Any] = {"user_metadata": dict(self.user_metadata), "limit": self.limit,
                                "owner": {"type": self.owner.type}}
        if isinstance(self.owner, UserSearchOwner):
            body["owner"]["owner_urns"] = list(self.owner.owner_urns)
        for name in ("project_ids", "base_models"):
            if getattr(self, name) is not None:
                body[name] = list(getattr(self, name))
        if self.checkpoint_type is not None:
            body["checkpoint_type"] = self.checkpoint_type
        if self.cursor is not None:
            body["cursor"] = {"last_created_at": self.cursor.last_created_at.isoformat(),
                              "last_checkpoint_uuid": self.cursor.last_checkpoint_uuid}
        return body


@dataclass
class CheckpointSearchResponse:
    """One page of search results, newest first; ``next_cursor`` None once exhausted."""

    checkpoints: list[Checkpoint]
    next_cursor: CheckpointSearchCursor | None = None


@dataclass
class TrainingRun:
    training_run_id: str
    base_model: str
    model_owner: str                # the tenant
    is_lora: bool
    last_request_time: datetime     # the newest training request's arrival (its creation before any)
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None
    expert_rank: int = 0            # the routed experts' LoRA rank in effect (MoE models); 0: no expert LoRA


@dataclass
class TrainingRunsResponse:
    training_runs: list[TrainingRun]
    cursor: Cursor


@dataclass
class WeightsInfoResponse:
    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
    expert_rank: int = 0            # the routed experts' LoRA rank (MoE models); 0: no expert LoRA


@dataclass
class GetSamplerResponse:
    sampler_id: str
    base_model: str
    model_path: str | None = None


@dataclass
class ParsedCheckpointTinkerPath:
    tinker_path: str
    training_run_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    checkpoint_id: str  # "<weights|sampler_weights>/<name>"

    @classmethod
    def from_tinker_path(cls, tinker_path: str) -> "ParsedCheckpointTinkerPath":
        kinds = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in kinds:
            raise ValueError(f"Invalid tinker path: {tinker_path}")
        return cls(tinker_path, parts[0], kinds[parts[1]], "/".join(parts[1:]))
