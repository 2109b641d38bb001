"""Fencing tokens at the trainer (issue 32, docs/replicas.md): a scheduler replica that lost a
trainer's lane must not change that trainer's adapters after the new owner has begun.

The lane owner sends its lease's fencing token with every call that changes the trainer's state
(``temper-lane-token`` metadata: RunCycle, Create/Load/Save/Snapshot/Restore/DropAdapter, deletes).
The trainer keeps the highest token it has been sent and refuses a call carrying a lower one with
FAILED_PRECONDITION, before the call runs. A call without the header (one scheduler, or a replica
that is not the lane's owner creating a new run there) is not fenced: tokens only order owners.
The new owner claims the trainer as soon as it takes the lane, so a frozen former owner that wakes
is refused from then on, whatever it had in flight.
"""

from __future__ import annotations

import grpc

from temper.common.errors import Authenticator, FailedPrecondition, InvalidArgument

LANE_TOKEN = "temper-lane-token"


def lane_token_metadata(token: int | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else ((LANE_TOKEN, str(token)),)


class LaneFence:
    """One trainer's highest fencing token seen (a new trainer process starts at 0)."""

    def __init__(self):
        self.highest = 0

    def check(self, metadata) -> None:
        raw = next((value for key, value in (metadata or ()) if key == LANE_TOKEN), None)
        if raw is None:
            return
        try:
            token = int(raw)
        except ValueError:
            raise InvalidArgument(f"{LANE_TOKEN} must be an integer, got {raw!r}") from None
        if token < self.highest:
            raise FailedPrecondition(f"this trainer's lane is now held under fencing token {self.highest}; the caller's "
                                     f"token {token} is older: that scheduler replica lost the lane and changes nothing here")
        self.highest = token


def fenced_authenticator(inner: Authenticator | None, fence: LaneFence) -> Authenticator:
    """``inner`` (the internal token check, if any), then the lane fence, before every call."""

    async def authenticate(method: str, context: grpc.aio.ServicerContext) -> None:
        if inner is not None:
            await inner(method, context)
        fence.check(context.invocation_metadata())

    return authenticate
