from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunMetric(_message.Message):
    __slots__ = ("seq_id", "step", "kind", "status", "error", "loss", "num_tokens", "grad_norm", "learning_rate", "metrics", "queued_seconds", "trainer_seconds", "cobatched_with", "trainer", "cycle", "created_unix_ms", "started_unix_ms", "answered_unix_ms")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COBATCHED_WITH_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    step: int
    kind: str
    status: str
    error: str
    loss: float
    num_tokens: int
    grad_norm: float
    learning_rate: float
    metrics: _containers.ScalarMap[str, float]
    queued_seconds: float
    trainer_seconds: float
    cobatched_with: int
    trainer: str
    cycle: int
    created_unix_ms: int
    started_unix_ms: int
    answered_unix_ms: int
    def __init__(self, seq_id: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[str] = ..., status: _Optional[str] = ..., error: _Optional[str] = ..., loss: _Optional[float] = ..., num_tokens: _Optional[int] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., queued_seconds: _Optional[float] = ..., trainer_seconds: _Optional[float] = ..., cobatched_with: _Optional[int] = ..., trainer: _Optional[str] = ..., cycle: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., started_unix_ms: _Optional[int] = ..., answered_unix_ms: _Optional[int] = ...) -> None: ...

class ListRunMetricsRequest(_message.Message):
    __slots__ = ("training_run_id", "from_step", "to_step", "page_size", "page_token")
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    from_step: int
    to_step: int
    page_size: int
    page_token: str
    def __init__(self, training_run_id: _Optional[str] = ..., from_step: _Optional[int] = ..., to_step: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunMetricsResponse(_message.Message):
    __slots__ = ("metrics", "next_page_token")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedCompositeFieldContainer[RunMetric]
    next_page_token: str
    def __init__(self, metrics: _Optional[_Iterable[_Union[RunMetric, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("limit", "offset", "project_id")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    limit: int
    offset: int
    project_id: str
    def __init__(self, limit: _Optional[int] = ..., offset: _Optional[int] = ..., project_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "tags", "user_metadata", "created_unix_ms", "last_heartbeat_unix_ms", "closed", "close_status", "closed_unix_ms", "training_run_ids", "sampler_ids", "sample_requests", "prompt_tokens", "tokens_sampled", "display_name", "project_id", "checkpoints_count", "checkpoint_bytes", "created_unix_us")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    CLOSE_STATUS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_US_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    created_unix_ms: int
    last_heartbeat_unix_ms: int
    closed: bool
    close_status: str
    closed_unix_ms: int
    training_run_ids: _containers.RepeatedScalarFieldContainer[str]
    sampler_ids: _containers.RepeatedScalarFieldContainer[str]
    sample_requests: int
    prompt_tokens: int
    tokens_sampled: int
    display_name: str
    project_id: str
    checkpoints_count: int
    checkpoint_bytes: int
    created_unix_us: int
    def __init__(self, session_id: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., created_unix_ms: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., closed: _Optional[bool] = ..., close_status: _Optional[str] = ..., closed_unix_ms: _Optional[int] = ..., training_run_ids: _Optional[_Iterable[str]] = ..., sampler_ids: _Optional[_Iterable[str]] = ..., sample_requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tokens_sampled: _Optional[int] = ..., display_name: _Optional[str] = ..., project_id: _Optional[str] = ..., checkpoints_count: _Optional[int] = ..., checkpoint_bytes: _Optional[int] = ..., created_unix_us: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "total_count")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    total_count: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., total_count: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SamplingRecord(_message.Message):
    __slots__ = ("sampler_id", "kind", "num_samples", "prompt_tokens", "tokens_sampled", "started_unix_ms", "answered_unix_ms")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    kind: str
    num_samples: int
    prompt_tokens: int
    tokens_sampled: int
    started_unix_ms: int
    answered_unix_ms: int
    def __init__(self, sampler_id: _Optional[str] = ..., kind: _Optional[str] = ..., num_samples: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tokens_sampled: _Optional[int] = ..., started_unix_ms: _Optional[int] = ..., answered_unix_ms: _Optional[int] = ...) -> None: ...

class SamplingBucket(_message.Message):
    __slots__ = ("start_unix_ms", "end_unix_ms", "requests", "prompt_tokens", "tokens_sampled", "busy_seconds")
    START_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    start_unix_ms: int
    end_unix_ms: int
    requests: int
    prompt_tokens: int
    tokens_sampled: int
    busy_seconds: float
    def __init__(self, start_unix_ms: _Optional[int] = ..., end_unix_ms: _Optional[int] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tokens_sampled: _Optional[int] = ..., busy_seconds: _Optional[float] = ...) -> None: ...

class GetSessionSamplingMetricsRequest(_message.Message):
    __slots__ = ("session_id", "from_unix_ms", "to_unix_ms", "bucket_seconds", "page_size", "page_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TO_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    from_unix_ms: int
    to_unix_ms: int
    bucket_seconds: int
    page_size: int
    page_token: str
    def __init__(self, session_id: _Optional[str] = ..., from_unix_ms: _Optional[int] = ..., to_unix_ms: _Optional[int] = ..., bucket_seconds: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class GetSessionSamplingMetricsResponse(_message.Message):
    __slots__ = ("records", "buckets", "next_page_token")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[SamplingRecord]
    buckets: _containers.RepeatedCompositeFieldContainer[SamplingBucket]
    next_page_token: str
    def __init__(self, records: _Optional[_Iterable[_Union[SamplingRecord, _Mapping]]] = ..., buckets: _Optional[_Iterable[_Union[SamplingBucket, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Project(_message.Message):
    __slots__ = ("project_id", "name", "created_unix_ms")
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    project_id: str
    name: str
    created_unix_ms: int
    def __init__(self, project_id: _Optional[str] = ..., name: _Optional[str] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...

class CreateProjectRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListProjectsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProjectsResponse(_message.Message):
    __slots__ = ("projects",)
    PROJECTS_FIELD_NUMBER: _ClassVar[int]
    projects: _containers.RepeatedCompositeFieldContainer[Project]
    def __init__(self, projects: _Optional[_Iterable[_Union[Project, _Mapping]]] = ...) -> None: ...

class AssignSessionProjectRequest(_message.Message):
    __slots__ = ("session_id", "project_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    project_id: str
    def __init__(self, session_id: _Optional[str] = ..., project_id: _Optional[str] = ...) -> None: ...

class SearchSessionsRequest(_message.Message):
    __slots__ = ("session_id", "project_ids", "user_metadata", "display_name", "statuses", "limit", "after_created_unix_us", "after_session_id")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_IDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_CREATED_UNIX_US_FIELD_NUMBER: _ClassVar[int]
    AFTER_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    project_ids: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    display_name: str
    statuses: _containers.RepeatedScalarFieldContainer[str]
    limit: int
    after_created_unix_us: int
    after_session_id: str
    def __init__(self, session_id: _Optional[str] = ..., project_ids: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., display_name: _Optional[str] = ..., statuses: _Optional[_Iterable[str]] = ..., limit: _Optional[int] = ..., after_created_unix_us: _Optional[int] = ..., after_session_id: _Optional[str] = ...) -> None: ...

class SearchSessionsResponse(_message.Message):
    __slots__ = ("sessions", "more", "tenant")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    more: bool
    tenant: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., more: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...
