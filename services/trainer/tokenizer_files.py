"""The base model's tokenizer as files, for ReadTokenizer: a client on another machine (no hub access,
no copy of the model folder) loads exactly the tokenizer this trainer uses, and, for a vision-language
model, its image processor (preprocessor_config.json) beside it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Iterator

from temper.services.trainer.checkpoints import CHUNK_BYTES, FilePiece


IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def tokenizer_files(tokenizer: Any, image_processor_json: str | None = None) -> dict[str, bytes]:
    """What ``save_pretrained`` writes (it records the tokenizer class, so the files load without the
    model's config.json), read into memory: a few MB, saved once per process. ``image_processor_json``:
    a vision-language model's preprocessor_config.json as the trainer read it (images.VisionProcessor),
    so the folder also loads the model's own image processor."""
    with tempfile.TemporaryDirectory(prefix="temper-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    if image_processor_json:
        files[IMAGE_PROCESSOR_FILE] = image_processor_json.encode()
    return files


def file_pieces(files: dict[str, bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[FilePiece]:
    """Each file in pieces of at most ``chunk_bytes``; an empty file is one empty piece."""
    for name, data in files.items():
        for offset in range(0, max(len(data), 1), chunk_bytes):
            yield FilePiece(name, offset, data[offset: offset + chunk_bytes], len(data))
