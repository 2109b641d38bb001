from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_TRAINER: _ClassVar[WorkerRole]
    WORKER_ROLE_SAMPLER: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_TRAINER: WorkerRole
WORKER_ROLE_SAMPLER: WorkerRole

class RegisterRequest(_message.Message):
    __slots__ = ("role", "address", "base_model", "capacity", "incarnation")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    address: str
    base_model: str
    capacity: int
    incarnation: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., base_model: _Optional[str] = ..., capacity: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_timeout_seconds",)
    HEARTBEAT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_timeout_seconds: float
    def __init__(self, heartbeat_timeout_seconds: _Optional[float] = ...) -> None: ...

class WorkerHeartbeatRequest(_message.Message):
    __slots__ = ("role", "address", "incarnation")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    address: str
    incarnation: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class WorkerHeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
