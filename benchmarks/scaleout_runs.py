"""The scale-out benchmark's client-side records: a tenant (its key and channel) and a training run
(its data and request sequence). Their own module because both the process launcher
(``scaleout_procs.py``: a stack holds its tenants and runs) and the load drivers (``scaleout_load.py``)
use them, and neither should import the other for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from temper.v1 import service_pb2_grpc


@dataclass
class Tenant:
    name: str
    key: str
    channel: grpc.aio.Channel | None = None
    stub: service_pb2_grpc.TemperStub | None = None
    metadata: tuple = ()
    session_id: str = ""


@dataclass
class Run:
    id: str
    tenant: Tenant
    data: list                 # the forward_backward's datums
    tokens: int                # forward_backward tokens
    next_seq: int = 1
    trainers: set = field(default_factory=set)  # fake trainer indexes its answers came from
    stub: service_pb2_grpc.TemperStub | None = None  # set: this run's calls go there, not the tenant's channel
    owner_stub: service_pb2_grpc.TemperStub | None = None  # hinted mode: the replica its last answer named the owner

    def take_seq(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq
