"""Which failures settle a sequenced request's seq at the scheduler, for every client that numbers
seqs (temper.client and the HTTP gateway): after any other failure the seq's fate is unknown to the
client, which then abandons it (AbandonSeq, docs/client.md "A seq given up on")."""

from __future__ import annotations

import grpc

# The scheduler answered: the seq was applied, or refused and spent, or there is nothing to spend it on
# (no such run, not the caller's). Everything else (UNAVAILABLE once retries are spent, a deadline, a
# cancel, a hard limit refused before admission, a failure inside the client) leaves it unknown.
SETTLED_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED})


def settles(exc: BaseException) -> bool:
    return getattr(exc, "code", None) in SETTLED_CODES
