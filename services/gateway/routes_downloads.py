"""Signed downloads of external_weights checkpoints (the SDK's RestClient.get_external_weights_urls).

GET .../checkpoints/external_weights/<name>/external_weights_urls (API key) asks the scheduler for
one token per file and answers absolute URLs ``/api/v1/external_weights/<run>/<name>/<file>?token=``;
those are fetched with no key (curl, a browser): the scheduler checks the token (403 when it does not
verify or has expired, 404 once the checkpoint is deleted) and the file is streamed through, never
held whole here.
"""

from __future__ import annotations

from datetime import datetime, timezone
from urllib.parse import quote

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from temper.common.checkpoints import CheckpointPath, check_name, parse_path
from temper.services.gateway import convert
from temper.services.gateway.app import api_key, gateway
from temper.services.gateway.errors import GatewayError, invalid
from temper.v1 import service_pb2, types_pb2

router = APIRouter(prefix="/api/v1")
FILE_ROUTE = "/external_weights/{run_id}/{name}/{relative_path}"
_MEDIA_TYPES = {".json": "application/json", ".safetensors": "application/octet-stream"}


def file_url(base_url: str, path: CheckpointPath, relative_path: str, token: str) -> str:
    """The absolute URL of one signed file (``base_url``: the request's, as the caller reached us)."""
    segments = "/".join(quote(part, safe="") for part in (path.training_run_id, path.name, relative_path))
    return f"{base_url.rstrip('/')}{router.prefix}/external_weights/{segments}?token={quote(token, safe='')}"


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(run_id: str, kind: str, name: str, request: Request):
    key = api_key(request)
    path = parse_path(convert.tinker_path(run_id, f"{kind}/{name}"))
    if path.kind != types_pb2.CHECKPOINT_KIND_EXTERNAL:
        raise invalid("only external_weights checkpoints have download URLs (save them with save_weights_external)")
    signed = await gateway(request).scheduler.call("SignCheckpointDownload",
                                                   service_pb2.SignCheckpointDownloadRequest(path=str(path)), key)
    base = str(request.base_url)
    expires = datetime.fromtimestamp(signed.expires_unix_ms / 1000, tz=timezone.utc)
    return {"urls": {f.relative_path: file_url(base, path, f.relative_path, f.token) for f in signed.files},
            "expires": expires.isoformat().replace("+00:00", "Z")}


@router.get(FILE_ROUTE)
async def external_weights_file(run_id: str, name: str, relative_path: str, request: Request):
    """No API key: the token is the authority (checked by the scheduler, which any replica can)."""
    token = request.query_params.get("token", "")
    if not token:
        raise GatewayError(grpc.StatusCode.PERMISSION_DENIED,
                           "a signed download URL carries ?token=: ask for URLs with get_external_weights_urls")
    path = CheckpointPath(run_id, types_pb2.CHECKPOINT_KIND_EXTERNAL, check_name(name))
    chunks = await gateway(request).scheduler.open_stream("ReadSignedCheckpointFile", service_pb2.ReadSignedCheckpointFileRequest(
        path=str(path), relative_path=relative_path, token=token), None)
    first = await anext(chunks)  # open_stream has read it already: its total_size is the file's size

    async def body():
        try:
            yield first.data
            async for chunk in chunks:
                yield chunk.data
        finally:
            await chunks.aclose()  # a client that went away cancels the scheduler's stream

    suffix = relative_path[relative_path.rfind("."):] if "." in relative_path else ""
    headers = {"Content-Length": str(first.total_size),
               "Content-Disposition": f"attachment; filename=\"{quote(relative_path, safe='')}\"",
               "Cache-Control": "private, no-store"}
    return StreamingResponse(body(), media_type=_MEDIA_TYPES.get(suffix, "application/octet-stream"), headers=headers)
