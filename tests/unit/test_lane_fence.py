"""The trainer's fencing-token check (common/lane_fence.py): a lower token than one already seen is
refused before the call runs; no token is not fenced; a bad token is a bad argument."""

from __future__ import annotations

import asyncio

import pytest

from temper.common.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from temper.common.lane_fence import LANE_TOKEN, LaneFence, fenced_authenticator, lane_token_metadata


class Context:
    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def call(authenticate, token):
    asyncio.run(authenticate("/temper.v1.Trainer/RunCycle", Context(lane_token_metadata(token))))


def test_a_former_owners_token_is_refused_once_a_newer_one_was_seen():
    fence = LaneFence()
    authenticate = fenced_authenticator(None, fence)
    call(authenticate, 1)
    call(authenticate, 1)   # the same owner again
    call(authenticate, 2)   # the lane's next owner
    with pytest.raises(FailedPrecondition, match="token 2.*token 1 is older"):
        call(authenticate, 1)
    assert fence.highest == 2
    call(authenticate, None)  # no token (one scheduler, or a replica creating a new run): not fenced
    assert fence.highest == 2


def test_a_token_that_is_not_a_number_is_a_bad_argument():
    authenticate = fenced_authenticator(None, LaneFence())
    with pytest.raises(InvalidArgument, match=LANE_TOKEN):
        asyncio.run(authenticate("/m", Context([(LANE_TOKEN, "two")])))


def test_the_internal_token_is_checked_first():
    async def refuse(method, context):
        raise Unauthenticated("no internal token")

    fence = LaneFence()
    with pytest.raises(Unauthenticated):
        call(fenced_authenticator(refuse, fence), 5)
    assert fence.highest == 0  # a refused caller moves nothing
