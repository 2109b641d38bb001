"""The header that opens a client-streamed upload (ImportCheckpoint, UploadImage): the first message, which
must carry it; its strings checked. INVALID_ARGUMENT, naming the verb's header, when it is missing."""

from __future__ import annotations

from temper.common.errors import InvalidArgument
from temper.common.strings import check_request_strings


async def first_header(messages, verb: str, what: str):
    """The ``header`` payload of the stream's first message (``verb``: the RPC, ``what``: "an import", "an upload")."""
    try:
        first = await messages.__anext__()
    except StopAsyncIteration:
        raise InvalidArgument(f"{what} starts with an {verb}Header") from None
    if first.WhichOneof("payload") != "header":
        raise InvalidArgument(f"the first {verb} message must be the header")
    check_request_strings(first.header)
    return first.header
