"""Files that travel as a stream of FileChunk messages into a service (an adapter upload): split into
chunks to send, and put back together on arrival with their names, order and size checked, in
memory, before anything is written anywhere."""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

from temper.common.errors import InvalidArgument
from temper.common.strings import shown
from temper.v1 import types_pb2

CHUNK_BYTES = 1 << 20


def file_chunks(files: Mapping[str, bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[types_pb2.FileChunk]:
    """Each file in pieces of at most ``chunk_bytes``, in order; an empty file is one empty piece."""
    for name, data in files.items():
        for offset in range(0, max(len(data), 1), chunk_bytes):
            yield types_pb2.FileChunk(relative_path=name, offset=offset, data=data[offset: offset + chunk_bytes],
                                      total_size=len(data))


class FileAssembly:
    """The files of one upload as their chunks arrive: only ``names``, each chunk where the last one
    ended, every file whole (its ``total_size``), all of them together at most ``max_bytes``."""

    def __init__(self, names: Iterable[str], max_bytes: int):
        self.names = tuple(names)
        self.max_bytes = max_bytes
        self.received = 0
        self._files: dict[str, bytearray] = {}
        self._sizes: dict[str, int] = {}

    def add(self, chunk: types_pb2.FileChunk) -> None:
        name = chunk.relative_path
        if name not in self.names:
            raise InvalidArgument(f"unexpected file {shown(name)}: the upload is {', '.join(self.names)}")
        data = self._files.setdefault(name, bytearray())
        if chunk.offset != len(data):
            raise InvalidArgument(f"{name}: a chunk at offset {chunk.offset}, expected {len(data)} (send each file in order)")
        size = self._sizes.setdefault(name, chunk.total_size)
        if chunk.total_size != size or len(data) + len(chunk.data) > size:
            raise InvalidArgument(f"{name}: chunks disagree with its total_size {size}")
        self.received += len(chunk.data)
        if self.received > self.max_bytes:
            raise InvalidArgument(f"the upload is larger than {self.max_bytes} bytes")
        data += chunk.data

    def files(self) -> dict[str, bytes]:
        """Every file, each whole; InvalidArgument when one is missing or cut short."""
        missing = [n for n in self.names if n not in self._files]
        if missing:
            raise InvalidArgument(f"the upload is missing {', '.join(missing)}")
        for name, data in self._files.items():
            if len(data) != self._sizes[name]:
                raise InvalidArgument(f"{name} ended after {len(data)} of its {self._sizes[name]} bytes")
        return {name: bytes(data) for name, data in self._files.items()}
