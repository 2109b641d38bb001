"""get_tokenizer() on any machine: the tokenizer files come from the server (GetTokenizer) and are
cached locally, so a client needs neither the model folder the trainer loaded nor hub access."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from temper.v1 import service_pb2

if TYPE_CHECKING:
    from temper.client.runtime import Runtime

COMPLETE = ".complete"  # written last: a folder without it is a download that did not finish


def cache_root() -> Path:
    """TEMPER_TOKENIZER_CACHE, else ~/.cache/temper/tokenizers (XDG_CACHE_HOME respected)."""
    if os.environ.get("TEMPER_TOKENIZER_CACHE"):
        return Path(os.environ["TEMPER_TOKENIZER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "temper" / "tokenizers"


def cache_folder(base_model: str, tokenizer_id: str) -> Path:
    """One folder per (model, tokenizer id): readable name, plus a hash so that two servers' models of
    the same name but different tokenizers do not share it."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", base_model).strip("._")[-80:] or "model"
    digest = hashlib.sha256(f"{base_model}\0{tokenizer_id}".encode()).hexdigest()[:12]
    return cache_root() / f"{readable}-{digest}"


def fetch_tokenizer_files(runtime: "Runtime", base_model: str, destination: Path) -> Path:
    """Stream the model's tokenizer files from the server into ``destination`` (replaced whole)."""
    chunks = runtime.stream("GetTokenizer", service_pb2.GetTokenizerRequest(base_model=base_model)).result()
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=destination.parent))
    try:
        handles: dict[str, Any] = {}
        try:
            for chunk in chunks:
                name = Path(chunk.relative_path).name  # never write outside the folder
                fh = handles.get(name) or handles.setdefault(name, open(staging / name, "wb"))
                fh.seek(chunk.offset)
                fh.write(chunk.data)
        finally:
            for fh in handles.values():
                fh.close()
        (staging / COMPLETE).write_text(base_model)
        shutil.rmtree(destination, ignore_errors=True)
        os.replace(staging, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return destination


def load_tokenizer(runtime: "Runtime", base_model: str, tokenizer_id: str) -> Any:
    """The server's tokenizer for ``base_model``: the folder ``tokenizer_id`` names when it exists here
    (same machine), else the local cache, else fetched from the server into the cache; a server
    without GetTokenizer leaves the hub (``tokenizer_id`` is then a hub id)."""
    from transformers import AutoTokenizer

    if tokenizer_id and os.path.isdir(tokenizer_id):
        return AutoTokenizer.from_pretrained(tokenizer_id)
    folder = cache_folder(base_model, tokenizer_id)
    if not (folder / COMPLETE).exists():
        try:
            fetch_tokenizer_files(runtime, base_model, folder)
        except Exception as exc:
            if getattr(exc, "code", None) != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return AutoTokenizer.from_pretrained(tokenizer_id or base_model)
    return AutoTokenizer.from_pretrained(str(folder))
