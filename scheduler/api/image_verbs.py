"""The tenant's uploaded images (issue 30): UploadImage, ListImages, DeleteImage.

An upload is a header (format; optionally a base model, to be told the image's N for it) and then
the file's bytes in pieces. The whole file is checked as any image input is (``images.open_image``
with the scheduler's image limits) in a thread, then stored for the calling tenant under
"temper-image://<sha256 of the bytes>" (db/images.py). The same bytes uploaded again by the same
tenant are the same image: answered with ``created`` false, nothing stored or counted again. A new
image counts in the tenant's storage with its checkpoints: past max_storage_bytes it is refused
(RESOURCE_EXHAUSTED) and nothing is stored. A refused upload leaves no row.
"""

from __future__ import annotations

import asyncio
import hashlib

from temper.common.errors import InvalidArgument, ResourceExhausted
from temper.common.strings import shown
from temper.scheduler.api.image_inputs import image_sha256, vision_of
from temper.scheduler.api.stream_header import first_header
from temper.scheduler.db.images import NewImage, StoredImage
from temper.scheduler.db.views import unix_ms
from temper.scheduler.tenancy.auth import caller, caller_actor
from temper.scheduler.tenancy.quotas import check_hard_limit
from temper.services.models.images import IMAGE_FORMATS, POINTER_SCHEME, open_image
from temper.v1 import service_pb2

MAX_LIST = 1000


def image_message(image: StoredImage, created: bool = False) -> service_pb2.ImageAsset:
    return service_pb2.ImageAsset(location=f"{POINTER_SCHEME}{image.sha256}", format=image.format, width=image.width,
                                  height=image.height, size_bytes=image.size_bytes, created_unix_ms=unix_ms(image.created_at),
                                  created=created)


class ImageVerbs:
    """Mixed into TemperServicer (store, backends, admission, _image_limits come from it)."""

    async def UploadImage(self, request_iterator, context):
        tenant = caller()
        limits = self._image_limits
        messages = request_iterator.__aiter__()
        header = await self._image_header(messages)
        data = bytearray()
        async for message in messages:
            if message.WhichOneof("payload") != "data":
                raise InvalidArgument("only the first UploadImage message is a header; the others carry the file's bytes")
            data += message.data
            if len(data) > limits.max_bytes:  # refused as it arrives: a huge stream is never held whole
                raise ResourceExhausted(f"image: over the limit of {limits.max_bytes} bytes per image")
        data = bytes(data)
        vision = None
        if header.base_model:
            vision = await self._upload_vision(header.base_model)
        # decoding is CPU work: off the event loop
        width, height = await asyncio.to_thread(open_image, data, header.format, limits, "image")
        expected = await asyncio.to_thread(vision.count, width, height) if vision is not None else None
        image = NewImage(hashlib.sha256(data).hexdigest(), header.format, width, height, data)
        stored, created = await self._store_image(tenant, image)
        answer = image_message(stored, created)
        if expected is not None:
            answer.expected_tokens = expected
        return answer

    async def _image_header(self, messages) -> service_pb2.UploadImageHeader:
        header = await first_header(messages, "UploadImage", "an upload")
        if header.format not in IMAGE_FORMATS:
            raise InvalidArgument(f"image: format {shown(header.format, 20)} is not one of {list(IMAGE_FORMATS)}")
        return header

    async def _upload_vision(self, base_model: str):
        """The processor of the base model an upload asks its N for (refused before anything is stored)."""
        workers = [w for w in [*self.backends.trainers, *self.backends.samplers] if w.info.base_model == base_model]
        if not workers:
            raise InvalidArgument(f"base_model {shown(base_model)} is not served here; served: {self.backends.model_names()}")
        vision = await asyncio.to_thread(vision_of, workers[0].info)
        if vision is None:
            raise InvalidArgument(f"base_model {shown(base_model)} takes text only; images need a vision-language base model")
        return vision

    async def _store_image(self, tenant: str, image: NewImage) -> tuple[StoredImage, bool]:
        """Stored unless the tenant has it; a new image within max_storage_bytes (held against the
        tenant's saves and imports by the same lock, so together they cannot cross it)."""
        async with self.admission.quotas.storage_lock(tenant):
            existing = await asyncio.to_thread(self.store.find_image, tenant, image.sha256)
            if existing is not None:  # the same bytes again: the same image, nothing more counted
                return existing, False
            limit = (await self.admission.quotas.limits(tenant)).max_storage_bytes
            if limit:
                used = await asyncio.to_thread(self.store.storage_bytes, tenant)
                check_hard_limit("max_storage_bytes", limit, used, adding=len(image.data))
            return await asyncio.to_thread(self.store.add_image, tenant, image, caller_actor())

    async def ListImages(self, request, context):
        limit = request.limit or 100
        if not 1 <= limit <= MAX_LIST or request.offset < 0:
            raise InvalidArgument(f"limit must be in [1, {MAX_LIST}] (0: 100) and offset >= 0")
        images, total = await asyncio.to_thread(self.store.list_images, caller(), limit, request.offset)
        return service_pb2.ListImagesResponse(images=[image_message(image) for image in images], total=total)

    async def DeleteImage(self, request, context):
        digest = image_sha256(request.location, "location")
        freed = await asyncio.to_thread(self.store.delete_image, caller(), digest, caller_actor())
        return service_pb2.DeleteImageResponse(freed_bytes=freed)
