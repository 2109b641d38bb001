"""Owner hints: clients send a run's lane verbs straight to the replica that owns its lane (issue 32).

A replicated scheduler answers every verb of a run's lane (``@on_lane_owner``) with trailing metadata
``temper-lane-owner: <address>``, the advertised address of the replica that owns the lane. A client
of several replicas (temper.client, the gateway's upstream) remembers that address per run and sends
the run's next lane verbs on a channel to that one replica, so they are not forwarded. Forwarding
stays the fallback: a stale hint reaches a replica that forwards (and names the new owner), and a
hint that fails UNAVAILABLE is dropped and the call resent once through the round_robin channel,
whose own retries then take over. One address (one scheduler) never uses this module.

The hint is a routing preference, never trusted for anything else: the replica it names checks the
caller's key and the lane's ownership like any other.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Callable

import grpc

from temper.common.channel_target import ROUND_ROBIN

LANE_OWNER = "temper-lane-owner"
# the stub methods scheduler/api/lane_routing.py's @on_lane_owner wraps (their requests carry training_run_id)
LANE_VERBS = frozenset({"ForwardBackward", "OptimStep", "SaveWeights", "LoadWeights", "AbandonSeq", "GetInfo"})
MAX_RUNS = 4096         # runs whose hint is kept (least recently used dropped first)
MAX_CHANNELS = 64       # replica addresses with a channel open; replicas are few, this bounds address churn
COOLDOWN_SECONDS = 15.0  # an address that failed a hinted call is not used as a hint for this long
CLOSE_GRACE_SECONDS = 60.0  # an evicted channel's calls in flight get this long to finish


def owner_in(metadata) -> str | None:
    """The owner hint in a call's trailing metadata, or None (one scheduler, or an error before routing)."""
    for key, value in metadata or ():
        if key == LANE_OWNER:
            return value if isinstance(value, str) else value.decode()
    return None


def hint_options(options: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """A replica channel's options: the round_robin channel's without round_robin (one address)."""
    return [option for option in options if option != ROUND_ROBIN]


class OwnerHints:
    """run id -> address of its lane's owner, least recently used dropped beyond ``capacity``.
    Addresses whose hinted call failed cool down for ``cooldown`` seconds: an owner that died, or an
    advertised address this client cannot reach (a compose name seen from the host), is not tried
    again on every call. Used on one event loop: no lock."""

    def __init__(self, capacity: int = MAX_RUNS, cooldown: float = COOLDOWN_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.capacity, self.cooldown, self.clock = capacity, cooldown, clock
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._cooling: dict[str, float] = {}  # address -> until when it is not used

    def __len__(self) -> int:
        return len(self._owners)

    def get(self, run_id: str) -> str | None:
        address = self._owners.get(run_id)
        if address is None:
            return None
        until = self._cooling.get(address)
        if until is not None:
            if self.clock() < until:
                return None
            del self._cooling[address]
        self._owners.move_to_end(run_id)
        return address

    def learn(self, run_id: str, address: str | None) -> None:
        if not run_id or not address:
            return
        self._owners[run_id] = address
        self._owners.move_to_end(run_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def failed(self, run_id: str, address: str) -> None:
        """A call hinted to ``address`` failed UNAVAILABLE: forget the run's hint, rest the address."""
        if self._owners.get(run_id) == address:
            del self._owners[run_id]
        self._cooling[address] = self.clock() + self.cooldown


class OwnerRouting:
    """Sends lane verbs to their run's hinted owner and learns hints from the answers.

    ``open_channel(address)`` opens a channel to one replica with the round_robin channel's credentials
    and options less round_robin (``hint_options``); ``make_stub`` wraps it. Channels are kept per
    address, at most ``max_channels``."""

    def __init__(self, open_channel: Callable[[str], grpc.aio.Channel], make_stub: Callable[[grpc.aio.Channel], Any],
                 hints: OwnerHints | None = None, max_channels: int = MAX_CHANNELS):
        self.open_channel, self.make_stub = open_channel, make_stub
        self.hints = hints or OwnerHints()
        self.max_channels = max_channels
        self._stubs: OrderedDict[str, tuple[grpc.aio.Channel, Any]] = OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def stub_for(self, address: str):
        entry = self._stubs.get(address)
        if entry is None:
            channel = self.open_channel(address)
            entry = self._stubs[address] = (channel, self.make_stub(channel))
            while len(self._stubs) > self.max_channels:
                _, (old, _) = self._stubs.popitem(last=False)
                task = asyncio.get_running_loop().create_task(old.close(CLOSE_GRACE_SECONDS))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._stubs.move_to_end(address)
        return entry[1]

    async def call(self, stub, method: str, request: Any, **kwargs) -> Any:
        """``method`` of ``request``'s run: on its hinted owner when there is one, else on ``stub``
        (the round_robin channel's) with ``kwargs`` as given. The hinted call does not wait for the
        channel to be ready: an owner that is gone fails it at once, and it is resent once on ``stub``.
        Errors other than that are the caller's (AioRpcError), as are the resend's."""
        run_id = request.training_run_id
        owner = self.hints.get(run_id)
        if owner is not None:
            try:
                return await self._learning(self.stub_for(owner), method, request, run_id, {**kwargs, "wait_for_ready": False})
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.hints.failed(run_id, owner)
        return await self._learning(stub, method, request, run_id, kwargs)

    async def _learning(self, stub, method: str, request: Any, run_id: str, kwargs: dict) -> Any:
        call = getattr(stub, method)(request, **kwargs)
        try:
            answer = await call
        except grpc.aio.AioRpcError as err:
            # an answer of the verb (NOT_FOUND of a seq, INVALID_ARGUMENT...) names the owner too; an
            # UNAVAILABLE one may come from an owner on its way out: not learnt
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                self.hints.learn(run_id, owner_in(err.trailing_metadata()))
            raise
        self.hints.learn(run_id, owner_in(await call.trailing_metadata()))
        return answer

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
