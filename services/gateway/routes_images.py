"""The caller's uploaded images over HTTP, for image_asset_pointer chunks (the scheduler's UploadImage,
ListImages and DeleteImage; the Tinker SDK has no upload of its own).

``POST /api/v1/images``: the file as the body (``Content-Type: image/png`` or ``image/jpeg``, e.g.
``curl --data-binary @cat.png -H 'Content-Type: image/png'``) or JSON ``{"data": base64, "format",
"base_model"}``; ``?base_model=`` with a raw body. Answers the asset: ``location``
("temper-image://<sha256>", what a pointer chunk names), format, size, ``created`` (false when these
bytes were uploaded already), and with a base model its ``expected_tokens``. The scheduler checks the
image (services/models/images.py) and counts it in the tenant's storage. ``GET /api/v1/images``
lists them (newest first, ``limit`` / ``offset``), ``DELETE /api/v1/images/{sha256}`` deletes one.
"""

from __future__ import annotations

from datetime import datetime, timezone

import grpc
from fastapi import APIRouter, Request

from temper.common.uploads import CHUNK_BYTES
from temper.services.gateway import fields, image_parts
from temper.services.gateway.app import api_key, gateway, json_body
from temper.services.gateway.errors import GatewayError, invalid
from temper.services.gateway.routes_rest import _page
from temper.services.models.images import POINTER_SCHEME
from temper.v1 import service_pb2

router = APIRouter(prefix="/api/v1")
_RAW_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}


def asset_to_json(asset: service_pb2.ImageAsset) -> dict:
    body = {"location": asset.location, "format": asset.format, "width": asset.width, "height": asset.height,
            "size_bytes": asset.size_bytes, "created": asset.created,
            "time": datetime.fromtimestamp(asset.created_unix_ms / 1000, tz=timezone.utc).isoformat()}
    if asset.HasField("expected_tokens"):
        body["expected_tokens"] = asset.expected_tokens
    return body


async def _upload_body(request: Request) -> tuple[bytes, str, str]:
    """(bytes, format, base model) of a raw image body or a JSON one."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in _RAW_TYPES:
        base_model = request.query_params.get("base_model", "")
        return await request.body(), _RAW_TYPES[content_type], fields.text(base_model, "base_model")
    if content_type not in ("", "application/json"):
        raise invalid(f"POST /api/v1/images takes image/png, image/jpeg or application/json, not {content_type[:40]!r}")
    body = await json_body(request)
    data = image_parts.decode_base64(body.get("data"), "data")
    fmt = image_parts.image_format(body.get("format"), "format")
    return data, fmt, fields.string(body, "base_model", default="")


@router.post("/images")
async def upload_image(request: Request):
    key = api_key(request)
    data, fmt, base_model = await _upload_body(request)
    messages = [service_pb2.UploadImageChunk(header=service_pb2.UploadImageHeader(format=fmt, base_model=base_model)),
                *(service_pb2.UploadImageChunk(data=data[i: i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES))]
    try:
        asset = await gateway(request).scheduler.upload("UploadImage", messages, key)
    except GatewayError as error:
        # an image over a size limit is final: 413, not the 429 of backpressure (which clients resend);
        # a full storage quota is a hard limit and stays 403
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not error.hard_limit:
            raise GatewayError(error.code, error.message, status=413) from None
        raise
    return asset_to_json(asset)


@router.get("/images")
async def list_images(request: Request):
    key = api_key(request)
    limit, offset = _page(request, 100)
    listed = await gateway(request).scheduler.call("ListImages", service_pb2.ListImagesRequest(limit=limit, offset=offset), key)
    return {"images": [asset_to_json(a) for a in listed.images], "total": listed.total}


@router.delete("/images/{digest}")
async def delete_image(digest: str, request: Request):
    """``digest``: the sha256 that the image's location ends with."""
    key = api_key(request)
    location = image_parts.pointer_location(POINTER_SCHEME + digest, "the image")
    freed = await gateway(request).scheduler.call("DeleteImage", service_pb2.DeleteImageRequest(location=location), key)
    return {"location": location, "freed_bytes": freed.freed_bytes}
