"""The time range of a session's trace or metrics: ``from_unix_ms`` and ``to_unix_ms`` query
parameters, by default the session's whole life (creation to close, or now)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request

from temper.services.gateway.errors import invalid

MAX_RANGE_MS = 31 * 24 * 3600 * 1000
DEFAULT_MAX_ROWS = 20000  # rows one trace or metrics answer may hold (TEMPER_GATEWAY_CONSOLE_MAX_ROWS)


def max_rows(request: Request) -> int:
    return getattr(request.app.state, "console_max_rows", DEFAULT_MAX_ROWS)


def _ms(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 15):
        raise invalid(f"{name} must be a non-negative integer (unix milliseconds)")
    return int(raw)


@dataclass(frozen=True)
class Range:
    start_ms: int
    end_ms: int


def session_range(request: Request, session) -> Range:
    now = int(time.time() * 1000)
    start = _ms(request, "from_unix_ms")
    end = _ms(request, "to_unix_ms")
    start = session.created_unix_ms if start is None else start
    end = (session.closed_unix_ms + 1 if session.closed else now + 1) if end is None else end
    if end <= start:
        raise invalid("to_unix_ms must be after from_unix_ms")
    if end - start > MAX_RANGE_MS:
        raise invalid(f"the range is longer than {MAX_RANGE_MS // 86_400_000} days: narrow it")
    return Range(start, end)
