"""Signed downloads of external_weights checkpoints (the SDK's get_external_weights_urls).

SignCheckpointDownload answers one token per file to a caller who may read the checkpoint (its
owner, or anyone once published); ReadSignedCheckpointFile streams one file to whoever holds a
token, with no API key (scheduler/tenancy/auth.py exempts it). The key is the shared "download"
signing key, so any replica verifies what any other signed.
"""

from __future__ import annotations

import asyncio
import time

from temper.common.checkpoints import WEIGHT_FILES, parse_path
from temper.common.errors import InvalidArgument, NotFound
from temper.scheduler.db.signing_keys import SigningKey, current_key, key_by_id
from temper.scheduler.db.views import unix_ms
from temper.scheduler.tenancy import download_tokens
from temper.scheduler.tenancy.auth import caller
from temper.v1 import service_pb2, types_pb2


class DownloadVerbs:
    """Mixed into TemperServicer (store, backends, runs, admission come from it)."""

    def _signing_key(self) -> SigningKey:
        with self.store.sessions.begin() as db:
            return current_key(db, download_tokens.PURPOSE, self.admission.settings.download_key_rotate_seconds)

    def _verifying_key(self, kid: str) -> SigningKey | None:
        settings = self.admission.settings
        # retired once nothing it signed can still be valid: it signed for rotate_seconds, each URL for url_seconds
        with self.store.sessions() as db:
            return key_by_id(db, download_tokens.PURPOSE, kid,
                             max_age_seconds=settings.download_key_rotate_seconds + settings.download_url_seconds)

    async def SignCheckpointDownload(self, request, context):
        path = parse_path(request.path)
        if path.kind != types_pb2.CHECKPOINT_KIND_EXTERNAL:
            raise InvalidArgument(f"only external_weights checkpoints have download URLs (save_weights_external), not {path}")
        reader = caller()
        row = await asyncio.to_thread(self.store.readable_checkpoint, str(path), reader)
        key = await asyncio.to_thread(self._signing_key)
        expires = int((time.time() + self.admission.settings.download_url_seconds) * 1000)
        generation = unix_ms(row.created_at)
        response = service_pb2.SignCheckpointDownloadResponse(expires_unix_ms=expires)
        for name in WEIGHT_FILES:  # an external_weights checkpoint is exactly these (LoraModel.files)
            response.files.add(relative_path=name, token=download_tokens.sign(key, str(path), name, expires, generation, reader))
        return response

    async def ReadSignedCheckpointFile(self, request, context):
        fields = download_tokens.parse(request.token)
        path = parse_path(request.path)
        key = await asyncio.to_thread(self._verifying_key, fields.kid)
        download_tokens.verify(key, fields, str(path), request.relative_path, int(time.time() * 1000))
        try:  # the reader's right, again: an unpublished checkpoint is no longer another tenant's to read
            row = await asyncio.to_thread(self.store.readable_checkpoint, str(path), fields.reader)
        except NotFound:
            raise NotFound(f"checkpoint {path} was deleted or is no longer published") from None
        expired = row.expires_at is not None and unix_ms(row.expires_at) <= int(time.time() * 1000)
        if unix_ms(row.created_at) != fields.generation or expired:  # deleted (and maybe saved again), or past its TTL
            raise NotFound(f"checkpoint {path} was deleted")
        await self.backends.wait_ready()
        run = await self.runs.get(row.training_run_id)
        trainer = self.backends.trainer_for(run.base_model, run.run_id)
        async for chunk in trainer.read_checkpoint(path.key, relative_path=request.relative_path):
            yield chunk
