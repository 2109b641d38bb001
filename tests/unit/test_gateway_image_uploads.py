"""POST /api/v1/images, GET /api/v1/images and DELETE /api/v1/images/{sha256} (routes_images.py) in process,
with a stand-in for the scheduler's UploadImage, ListImages and DeleteImage: the file streamed in order, the
asset answered as JSON, bad bodies refused before any call, and the scheduler's refusals with final statuses."""

import base64

import grpc
from fastapi.testclient import TestClient

from fixtures_stack import png_bytes
from temper.services.gateway.app import create_app
from temper.services.gateway.errors import GatewayError
from temper.v1 import service_pb2

KEY = {"Authorization": "Bearer tml-k"}
RED, BLUE = png_bytes("red"), png_bytes("blue", (128, 64), "JPEG")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Uploads:
    """UploadImage, ListImages and DeleteImage as the scheduler answers them; records the streams."""

    def __init__(self, error: GatewayError | None = None):
        self.streams, self.calls, self.error = [], [], error

    async def upload(self, method, messages, key):
        self.streams.append((method, messages, key))
        if self.error:
            raise self.error
        data = b"".join(m.data for m in messages[1:])
        return service_pb2.ImageAsset(location="temper-image://" + "0" * 64, format=messages[0].header.format, width=64,
                                      height=64, size_bytes=len(data), created_unix_ms=0, created=True, expected_tokens=4)

    async def call(self, method, request, key):
        self.calls.append((method, request))
        if method == "ListImages":
            return service_pb2.ListImagesResponse(images=[service_pb2.ImageAsset(location="temper-image://" + "0" * 64)], total=1)
        return service_pb2.DeleteImageResponse(freed_bytes=7)

    async def close(self):
        pass


def test_image_upload_routes():
    from temper.common.errors import HARD_LIMIT_PREFIX

    scheduler = Uploads()
    with TestClient(create_app(scheduler)) as http:
        raw = http.post("/api/v1/images?base_model=tiny-vl", headers={**KEY, "Content-Type": "image/png"}, content=RED)
        assert raw.status_code == 200, raw.text
        assert raw.json()["location"] == "temper-image://" + "0" * 64 and raw.json()["expected_tokens"] == 4
        method, messages, key = scheduler.streams[-1]
        assert (method, key, messages[0].header.format, messages[0].header.base_model) == ("UploadImage", "tml-k", "png", "tiny-vl")
        assert b"".join(m.data for m in messages[1:]) == RED
        as_json = http.post("/api/v1/images", headers=KEY, json={"data": b64(BLUE), "format": "jpeg"})
        assert as_json.status_code == 200 and as_json.json()["size_bytes"] == len(BLUE)
        assert scheduler.streams[-1][1][0].header.format == "jpeg" and not scheduler.streams[-1][1][0].header.base_model
        assert http.get("/api/v1/images?limit=5", headers=KEY).json()["total"] == 1
        assert scheduler.calls[-1][1].limit == 5
        deleted = http.delete("/api/v1/images/" + "0" * 64, headers=KEY).json()
        assert deleted == {"location": "temper-image://" + "0" * 64, "freed_bytes": 7}
        streams = len(scheduler.streams)
        for resp, words in [
            (http.post("/api/v1/images", headers=KEY, json={"data": "**", "format": "png"}), "data is not valid base64"),
            (http.post("/api/v1/images", headers=KEY, json={"data": b64(RED), "format": "gif"}), "format must be one of"),
            (http.post("/api/v1/images", headers={**KEY, "Content-Type": "image/gif"}, content=RED), "image/gif"),
            (http.delete("/api/v1/images/abc", headers=KEY), "temper-image://<sha256>"),
        ]:
            assert resp.status_code == 400 and words in resp.json()["error"], resp.text
        assert http.post("/api/v1/images", json={"data": b64(RED), "format": "png"}).status_code == 401
        assert len(scheduler.streams) == streams
        # the scheduler's refusals: too large is final (413), a full storage quota 403, a bad image 400
        for error, status in [(GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "image: over the limit of 9 bytes"), 413),
                              (GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, HARD_LIMIT_PREFIX + "max_storage_bytes"), 403),
                              (GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "image: corrupt PNG image"), 400)]:
            scheduler.error = error
            resp = http.post("/api/v1/images", headers={**KEY, "Content-Type": "image/png"}, content=RED)
            assert resp.status_code == status and resp.headers["x-should-retry"] == "false", resp.text
