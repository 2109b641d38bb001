"""Logging set-up shared by every Temper process: text or JSON lines, and request context.

``request_context(run=..., seq=..., tenant=...)`` binds fields to everything logged inside it (a
contextvar, so it follows asyncio tasks and ``asyncio.to_thread``); every record carries them, as
``key=value`` in text and as JSON fields.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

_context: contextvars.ContextVar[dict] = contextvars.ContextVar("temper_log_context", default={})


class request_context:  # noqa: N801 - used as a function: ``with request_context(run=...):``
    """Binds ``fields`` (those not None) to what is logged inside the block. A class rather than a
    generator context manager: it is entered on every sequenced verb (cheaper by half)."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields):
        self._fields = fields

    def __enter__(self):
        self._token = _context.set({**_context.get(), **{k: v for k, v in self._fields.items() if v is not None}})

    def __exit__(self, *exc):
        _context.reset(self._token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.context = _context.get()
        return True


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = getattr(record, "context", None)
        if context:
            line += " [" + " ".join(f"{k}={v}" for k, v in context.items()) + "]"
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            **getattr(record, "context", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_ContextFilter())
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
