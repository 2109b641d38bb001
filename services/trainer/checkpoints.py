"""Checkpoint folders on local disk, addressed by key ("<run>/<kind>/<name>").

Writes go to a temporary sibling and are renamed into place, so a reader never sees half a
checkpoint. Durable object storage can replace this class behind the same three methods.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from temper.common.checkpoints import WEIGHT_FILES
from temper.common.errors import AlreadyExists, InvalidArgument, NotFound
from temper.v1 import types_pb2

CHUNK_BYTES = 1 << 20
_SAFE_PART = re.compile(r"^[A-Za-z0-9._:@+-]+$")


class CheckpointStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        parts = key.split("/")
        if len(parts) != 3 or not all(_SAFE_PART.match(p) and p not in (".", "..") for p in parts):
            raise InvalidArgument(f"bad checkpoint key {key!r}")
        return self.root.joinpath(*parts)

    def exists(self, key: str) -> bool:
        return self.path(key).is_dir()

    def staging_dir(self, key: str) -> Path:
        final = self.path(key)
        if final.exists():
            raise AlreadyExists(f"checkpoint {key} already exists")
        final.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))

    def publish(self, staging: Path, key: str) -> int:
        final = self.path(key)
        staging.rename(final)
        return sum(f.stat().st_size for f in final.iterdir() if f.is_file())

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def existing(self, key: str) -> Path:
        path = self.path(key)
        if not path.is_dir():
            raise NotFound(f"checkpoint {key} not found on this trainer")
        return path

    def read_chunks(self, key: str, weights_only: bool) -> Iterator[types_pb2.FileChunk]:
        folder = self.existing(key)
        files = [folder / n for n in WEIGHT_FILES] if weights_only else sorted(p for p in folder.iterdir() if p.is_file())
        for file in files:
            size = file.stat().st_size
            with open(file, "rb") as fh:
                offset = 0
                while True:
                    data = fh.read(CHUNK_BYTES)
                    if not data and offset:
                        break
                    yield types_pb2.FileChunk(relative_path=file.name, offset=offset, data=data, total_size=size)
                    offset += len(data)
                    if offset >= size:
                        break
