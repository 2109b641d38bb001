"""Checkpoint folders on local disk, addressed by key ("<run>/<kind>/<name>").

Writes go to a temporary sibling and are renamed into place, so a reader never sees half a
checkpoint; deletes rename the folder away to a hidden sibling first, then remove that. A discarded
write and a delete also remove the ``<run>/`` and ``<run>/<kind>/`` folders they leave empty: a
refused or undone call leaves the tree as it found it. Durable object storage can replace this class
behind the same methods.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

from temper.common.errors import AlreadyExists, InvalidArgument, NotFound

CHUNK_BYTES = 1 << 20


class FilePiece(NamedTuple):
    relative_path: str
    offset: int
    data: bytes
    total_size: int   # of the whole file
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
        for attempt in range(3):
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
            except FileNotFoundError:  # another trainer on the shared folder pruned the empty parent meanwhile
                if attempt == 2:
                    raise

    def publish(self, staging: Path, key: str, sync: bool = False) -> int:
        """Rename the staged folder into place; the bytes of its files. ``sync``: its files and the
        folder are flushed to disk before the rename and the rename after it, so that a machine that
        loses power keeps the checkpoint whole or not at all (snapshots that outlive their trainer)."""
        final = self.path(key)
        if sync:
            for file in staging.iterdir():
                _fsync(file)
            _fsync(staging)
        staging.rename(final)
        if sync:
            _fsync(final.parent)
        return sum(f.stat().st_size for f in final.iterdir() if f.is_file())

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)
        self._prune(staging.parent)

    def _prune(self, folder: Path) -> None:
        """Remove ``folder`` and its parents below the root while they are empty (rmdir refuses a
        folder that is not: a concurrent write into it keeps it)."""
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty, or already gone
                return
            folder = folder.parent

    def delete(self, key: str) -> int:
        """Remove the checkpoint's folder; the bytes freed, 0 if there was none (deleting twice is
        fine). The folder leaves its key in one rename: a reader that opens it later finds it whole or not at all."""
        final = self.path(key)
        if not final.is_dir():
            return 0
        doomed = final.with_name(f".{final.name}.deleted-{uuid.uuid4().hex}")
        try:
            final.rename(doomed)
        except FileNotFoundError:  # deleted meanwhile
            return 0
        freed = sum(f.stat().st_size for f in doomed.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(doomed, ignore_errors=True)
        self._prune(final.parent)
        return freed

    def copy(self, source_key: str, key: str) -> int:
        """The source checkpoint's files under ``key`` (issue 33, copy_weights); the bytes of the copy.
        Each file is hard-linked where the filesystem allows (checkpoint files are never written in
        place: deleting the source unlinks only its names), else copied. Staged and renamed into place
        as a save is: a failure leaves no folder under ``key``."""
        source = self.existing(source_key)
        staging = self.staging_dir(key)
        try:
            for file in sorted(p for p in source.iterdir() if p.is_file()):
                try:
                    os.link(file, staging / file.name)
                except OSError:  # another filesystem, or links not supported
                    shutil.copy2(file, staging / file.name)
            return self.publish(staging, key)
        except BaseException:
            self.discard(staging)
            raise

    def existing(self, key: str) -> Path:
        path = self.path(key)
        if not path.is_dir():
            raise NotFound(f"checkpoint {key} not found on this trainer")
        return path

    def read_chunks(self, key: str, names: Sequence[str] | None = None) -> Iterator[FilePiece]:
        """The checkpoint's files (only ``names`` when given) in pieces of at most CHUNK_BYTES; an
        empty file is one empty piece."""
        folder = self.existing(key)
        files = [folder / n for n in names] if names is not None else sorted(p for p in folder.iterdir() if p.is_file())
        for file in files:
            size = file.stat().st_size
            with open(file, "rb") as fh:
                offset = 0
                while True:
                    data = fh.read(CHUNK_BYTES)
                    if not data and offset:
                        break
                    yield FilePiece(file.name, offset, data, size)
                    offset += len(data)
                    if offset >= size:
                        break


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
