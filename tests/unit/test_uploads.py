"""Uploads as FileChunk streams (common/uploads.py): split and put back together, with names, order,
sizes and the total bound checked before anything is written."""

import pytest

from temper.common.errors import InvalidArgument
from temper.common.uploads import FileAssembly, file_chunks
from temper.v1 import types_pb2

NAMES = ("a.json", "b.bin")


def test_files_round_trip_through_chunks():
    files = {"a.json": b"{}", "b.bin": bytes(range(256)) * 5}
    chunks = list(file_chunks({**files}, chunk_bytes=100))
    assert len(chunks) == 1 + 13
    upload = FileAssembly(NAMES, max_bytes=2000)
    for chunk in chunks:
        upload.add(chunk)
    assert upload.files() == files
    empty = FileAssembly(("e",), 10)
    for chunk in file_chunks({"e": b""}):
        empty.add(chunk)
    assert empty.files() == {"e": b""}


@pytest.mark.parametrize("case", ["unknown name", "out of order", "past total", "too large", "cut short", "missing"])
def test_bad_uploads_are_refused(case):
    files = {"a.json": b"{}", "b.bin": b"x" * 300}
    chunks = list(file_chunks(files, chunk_bytes=100))
    upload = FileAssembly(NAMES, max_bytes=250 if case == "too large" else 1000)
    if case == "unknown name":
        chunks[0] = types_pb2.FileChunk(relative_path="../evil", data=b"x", total_size=1)
    elif case == "out of order":
        chunks[1], chunks[2] = chunks[2], chunks[1]
    elif case == "past total":
        chunks[-1].data += b"more"
    elif case == "cut short":
        chunks.pop()
    elif case == "missing":
        chunks = chunks[:1]
    with pytest.raises(InvalidArgument):
        for chunk in chunks:
            upload.add(chunk)
        upload.files()
