"""A cap on request bodies: a larger one is refused with 413 before it is held in memory whole.

An ASGI middleware that wraps ``receive``: the route's first read of the body raises ``too_large``
when ``Content-Length`` says the body is over the limit, and so does any read that takes a streamed
(chunked) body over it. The error is raised inside the route, so the route's own error handling
answers it (the SDK's JSON shape, or OpenAI's under /v1). Protobuf bodies (forward_backward) may be
as large as a scheduler message; JSON ones get a smaller limit, as parsing them takes several times
their size in memory.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from temper.common.server_options import MAX_MESSAGE_BYTES
from temper.services.gateway.errors import too_large

PROTOBUF_LIMIT = MAX_MESSAGE_BYTES
JSON_LIMIT = 64 * 1024 * 1024


class BodyLimit:
    def __init__(self, app: ASGIApp, json_limit: int = JSON_LIMIT, protobuf_limit: int = PROTOBUF_LIMIT):
        self.app = app
        self.json_limit = json_limit
        self.protobuf_limit = protobuf_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = self.protobuf_limit if "protobuf" in headers.get("content-type", "") else self.json_limit
        declared = headers.get("content-length", "")
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            if declared.isdigit() and int(declared) > limit:
                raise too_large(limit)
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(limit)
            return message

        await self.app(scope, limited, send)
