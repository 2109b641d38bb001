"""Owner hints (common/owner_hints.py, issue 32): the scheduler names a lane's owner in a lane verb's
trailing metadata (scheduler/api/lane_routing.py); temper.client and the gateway's upstream send the
run's next lane verbs there, drop a hint that fails UNAVAILABLE and resend through round_robin. The
hint cache alone, the servicer's wrapper with fakes, and both clients against two small gRPC servers
on loopback standing in for replicas."""

from __future__ import annotations

import asyncio
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from temper.client.runtime import Runtime
from temper.common.errors import InvalidArgument, Unavailable
from temper.common.owner_hints import LANE_OWNER, OwnerHints, owner_in
from temper.scheduler.api.lane_routing import LaneRouting, on_lane_owner
from temper.scheduler.cluster.ownership import SoleOwner
from temper.scheduler.tenancy.auth import reset_caller, set_caller
from temper.services.gateway.upstream import Scheduler
from temper.v1 import service_pb2, service_pb2_grpc, types_pb2


# ---- the cache --------------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hints_keep_the_most_recently_used_runs():
    hints = OwnerHints(capacity=2)
    hints.learn("a", "10.0.0.1:1")
    hints.learn("b", "10.0.0.2:1")
    assert hints.get("a") == "10.0.0.1:1"  # a is now the most recent: c pushes b out
    hints.learn("c", "10.0.0.1:1")
    assert (hints.get("a"), hints.get("b"), hints.get("c"), len(hints)) == ("10.0.0.1:1", None, "10.0.0.1:1", 2)
    hints.learn("a", "10.0.0.2:1")  # a newer answer names another owner
    assert hints.get("a") == "10.0.0.2:1"


def test_no_hint_is_learnt_from_an_answer_without_one_or_a_run_without_an_id():
    hints = OwnerHints()
    hints.learn("a", "10.0.0.1:1")
    hints.learn("a", None)  # an error before routing names nobody: the hint stays
    hints.learn("", "10.0.0.2:1")
    assert (hints.get("a"), hints.get(""), len(hints)) == ("10.0.0.1:1", None, 1)
    assert owner_in(grpc.aio.Metadata((LANE_OWNER, "10.0.0.3:1"))) == "10.0.0.3:1"
    assert owner_in(grpc.aio.Metadata(("other", "x"))) is None


def test_a_failed_address_is_dropped_for_its_run_and_rests_for_the_others():
    clock = Clock()
    hints = OwnerHints(cooldown=15.0, clock=clock)
    hints.learn("a", "10.0.0.1:1")
    hints.learn("b", "10.0.0.1:1")
    hints.learn("c", "10.0.0.2:1")
    hints.failed("a", "10.0.0.1:1")
    assert (hints.get("a"), hints.get("b"), hints.get("c")) == (None, None, "10.0.0.2:1")
    clock.now += 15.0
    assert (hints.get("a"), hints.get("b")) == (None, "10.0.0.1:1")  # b's hint is used again after the rest


# ---- the servicer's wrapper -------------------------------------------------------------------------


class Context:
    def __init__(self):
        self.trailing = None

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata):
        self.trailing = tuple(metadata)


class Forwarder:
    def __init__(self, outcome):
        self.outcome, self.calls = outcome, []

    async def forward(self, address, method, request, context):
        self.calls.append((address, method))
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class Ownership:
    replicated = True
    address = "10.0.0.1:50051"

    def __init__(self, route):
        self._route = route

    async def route(self, lane):
        return self._route

    def holds(self, lane):
        return self._route is None


class Servicer(LaneRouting):
    def __init__(self, ownership, forwarder=None):
        self.ownership, self.forwarder = ownership, forwarder
        run = SimpleNamespace(run_id="r1", base_model="m")
        self.runs = SimpleNamespace(get=self._get(run), known=lambda run_id: None, forget=lambda run_id: None)
        self.backends = SimpleNamespace(wait_ready=self._ready, trainer_for=lambda model, run_id: SimpleNamespace(address="t1"),
                                        placements={})

    @staticmethod
    def _get(run):
        async def get(run_id, tenant=None):
            return run
        return get

    @staticmethod
    async def _ready():
        return None

    @on_lane_owner
    async def GetInfo(self, request, context):
        if request.training_run_id == "refused":
            raise InvalidArgument("refused here")
        return "ran here"


def serve(servicer, run_id="r1"):
    async def go():
        token = set_caller("alice")
        try:
            context = Context()
            try:
                answer = await servicer.GetInfo(service_pb2.GetInfoRequest(training_run_id=run_id), context)
            except Exception as exc:  # noqa: BLE001 - the test looks at what the error carried
                answer = exc
            return answer, context.trailing
        finally:
            reset_caller(token)
    return asyncio.run(go())


def test_a_verb_run_here_names_this_replica_even_when_it_refuses():
    assert serve(Servicer(Ownership(None))) == ("ran here", ((LANE_OWNER, "10.0.0.1:50051"),))
    answer, trailing = serve(Servicer(Ownership(None)), "refused")
    assert isinstance(answer, InvalidArgument) and trailing == ((LANE_OWNER, "10.0.0.1:50051"),)


def test_a_forwarded_verb_names_the_owner_unless_the_owner_could_not_be_reached():
    ok = Servicer(Ownership("10.0.0.2:50051"), Forwarder("owner's answer"))
    assert serve(ok) == ("owner's answer", ((LANE_OWNER, "10.0.0.2:50051"),))
    assert ok.forwarder.calls == [("10.0.0.2:50051", "GetInfo")]
    answer, trailing = serve(Servicer(Ownership("10.0.0.2:50051"), Forwarder(InvalidArgument("owner refused"))))
    assert isinstance(answer, InvalidArgument) and trailing == ((LANE_OWNER, "10.0.0.2:50051"),)
    answer, trailing = serve(Servicer(Ownership("10.0.0.2:50051"), Forwarder(Unavailable("owner gone"))))
    assert isinstance(answer, Unavailable) and trailing is None


def test_one_scheduler_adds_nothing():
    assert serve(Servicer(SoleOwner())) == ("ran here", None)


# ---- clients against two stand-in replicas -----------------------------------------------------------


class Replica(service_pb2_grpc.TemperServicer):
    """Answers GetInfo and ForwardBackward, naming ``cluster.owner`` as the lane's owner; counts its calls."""

    def __init__(self, cluster):
        self.cluster, self.calls = cluster, 0

    def GetInfo(self, request, context):
        self.calls += 1
        context.set_trailing_metadata(((LANE_OWNER, self.cluster.owner),))
        return service_pb2.TrainingRunInfo(training_run_id=request.training_run_id)

    def ForwardBackward(self, request, context):
        self.GetInfo(request, context)
        return types_pb2.ForwardBackwardOutput()

    def ListTrainingRuns(self, request, context):
        self.calls += 1
        return service_pb2.ListTrainingRunsResponse()


@pytest.fixture
def replicas():
    """Two servers; ``cluster.owner`` (what both name) starts as the second's address."""
    cluster = SimpleNamespace(servers=[], replicas=[], addresses=[])
    for _ in range(2):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        replica = Replica(cluster)
        service_pb2_grpc.add_TemperServicer_to_server(replica, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        cluster.servers.append(server)
        cluster.replicas.append(replica)
        cluster.addresses.append(f"127.0.0.1:{port}")
    cluster.owner = cluster.addresses[1]
    yield cluster
    for server in cluster.servers:
        server.stop(None)


def test_the_client_sends_a_runs_lane_verbs_to_its_owner_and_falls_back_when_the_owner_dies(replicas):
    first, owner = replicas.replicas
    runtime = Runtime(",".join(replicas.addresses), [], max_retries=3, connect_timeout=10)
    try:
        get = service_pb2.GetInfoRequest(training_run_id="s:train:0")
        assert runtime.rpc("GetInfo", get).result(10).training_run_id == "s:train:0"  # through round_robin
        before = first.calls
        for i in range(6):
            request = get if i % 2 else service_pb2.ForwardBackwardRequest(training_run_id="s:train:0", seq_id=i)
            runtime.rpc(type(request).__name__.removesuffix("Request"), request).result(10)
        assert first.calls == before  # every later lane verb went to the owner named
        [runtime.rpc("ListTrainingRuns", service_pb2.ListTrainingRunsRequest()).result(10) for _ in range(4)]
        assert first.calls > before  # other verbs still spread over both
        replicas.servers[1].stop(None)  # the owner dies; the survivor names itself from now on
        replicas.owner = replicas.addresses[0]
        assert runtime.rpc("GetInfo", get).result(10).training_run_id == "s:train:0"
        assert runtime.owners.hints.get("s:train:0") == replicas.addresses[0]
    finally:
        runtime.close()


def test_one_address_opens_no_other_channel(replicas):
    runtime = Runtime(replicas.addresses[0], [], connect_timeout=10)
    try:
        runtime.rpc("GetInfo", service_pb2.GetInfoRequest(training_run_id="s:train:0")).result(10)
        assert runtime.owners is None
    finally:
        runtime.close()


def test_the_gateway_upstream_uses_the_hints_too(replicas):
    first, owner = replicas.replicas

    async def go():
        upstream = Scheduler(",".join(replicas.addresses))
        try:
            request = service_pb2.GetInfoRequest(training_run_id="s:train:1")
            await upstream.verb("GetInfo", request, "k")
            before = first.calls
            for _ in range(4):
                await upstream.verb("GetInfo", request, "k")
                await upstream.call("GetInfo", request, "k")
            assert first.calls == before
            replicas.servers[1].stop(None)
            replicas.owner = replicas.addresses[0]
            assert (await upstream.verb("GetInfo", request, "k")).training_run_id == "s:train:1"
            assert upstream._owners.hints.get("s:train:1") == replicas.addresses[0]
        finally:
            await upstream.close()

    asyncio.run(go())
