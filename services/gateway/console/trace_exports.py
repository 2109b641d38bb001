"""The session trace exports behind the Tinker SDK's ``RestClient.export_session_trace``: one build
job per session, its file kept in the gateway's memory, handed out through signed, expiring URLs.

The SDK's protocol (tinker 0.38): it polls the export route until the answer is ``ready`` (then it
returns ``url``) or ``failed`` (it raises with ``error``); on ``pending`` it sleeps 5 s and polls
again. So the first poll starts the build and waits a moment for it (a small session is ready at
once, and the SDK never sleeps); a larger one answers ``pending`` until its build is done. A build
already handed out is reused only while it is still up to date: the session was closed when it was
built (nothing can change after a close). An open session's next export is built afresh.

The URL needs no key (a plain GET, as the SDK's docs show): it names the export and its expiry and
carries an HMAC of both under a key made at process start. A tampered or expired URL is refused
(403); an export no longer kept is 404. Exports live in this process: a URL is served by the gateway
that signed it, and a gateway restart ends it (the caller exports again)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from temper.services.gateway.errors import GatewayError

URL_SECONDS = 3600.0  # how long a signed URL (and the export it names) lasts, as the SDK's docs say
FIRST_WAIT_SECONDS = 2.0  # how long a poll waits for a build before answering pending
MAX_EXPORTS = 16  # exports kept at once (each holds a whole trace, up to ~10 MB at console_max_rows); the oldest go first

Build = Callable[[], Awaitable[bytes]]


def _refused(message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.PERMISSION_DENIED, message)  # 403


@dataclass
class _Export:
    export_id: str
    session_id: str
    closed_when_started: bool
    task: asyncio.Task
    started: float = field(default_factory=time.time)
    order: int = field(default_factory=itertools.count().__next__)  # start order (times can tie)
    handed_out: bool = False
    keep_until: float = 0.0  # the latest expiry of a URL handed out for it (0: none yet)

    def body(self) -> bytes | None:
        """The built file; None while building or after a failure."""
        if not self.task.done() or self.task.cancelled() or self.task.exception() is not None:
            return None
        return self.task.result()


class TraceExports:
    """Export jobs by session id. Callers have checked the session is the caller's (GetSession with
    the caller's key) before every poll: a session id belongs to one tenant, so the jobs need no
    tenant of their own."""

    def __init__(self, first_wait_seconds: float = FIRST_WAIT_SECONDS, url_seconds: float = URL_SECONDS,
                 max_exports: int = MAX_EXPORTS):
        self.first_wait_seconds = first_wait_seconds
        self.url_seconds = url_seconds
        self.max_exports = max_exports
        self._key = secrets.token_bytes(32)
        self._by_session: dict[str, _Export] = {}
        self._by_id: dict[str, _Export] = {}

    async def poll(self, session_id: str, session_closed: bool, build: Build) -> dict:
        """One poll of the SDK: ``{"status": "pending" | "ready" | "failed", "url", "error"}``, where
        ``url`` is a path and query ("/...") the route makes absolute."""
        self._forget_expired()
        job = self._by_session.get(session_id)
        if job is None or (job.handed_out and not job.closed_when_started):
            job = self._start(session_id, session_closed, build)
        if not job.task.done():
            await asyncio.wait({job.task}, timeout=self.first_wait_seconds)
            if not job.task.done():
                return {"status": "pending", "url": None, "error": None}
        error = None if job.task.cancelled() else job.task.exception()
        if job.task.cancelled() or error is not None:
            self._drop(job)  # the next export tries again
            message = error.message if isinstance(error, GatewayError) else "the trace could not be built"
            return {"status": "failed", "url": None, "error": message}
        job.handed_out = True
        return {"status": "ready", "url": self._signed_path(job), "error": None}

    def download(self, export_id: str, expires: str, signature: str) -> tuple[_Export, bytes]:
        if not (expires.isascii() and expires.isdigit() and len(expires) <= 15):
            raise _refused("the download URL is malformed: export the trace again")
        if not hmac.compare_digest(self._sign(export_id, int(expires)), signature):
            raise _refused("the download URL's signature does not match")
        if int(expires) < time.time():
            raise _refused("the download URL has expired: export the trace again")
        job = self._by_id.get(export_id)
        body = job.body() if job is not None else None
        if body is None:
            raise GatewayError(grpc.StatusCode.NOT_FOUND, "this trace export is no longer kept: export the trace again")
        return job, body

    def _start(self, session_id: str, session_closed: bool, build: Build) -> _Export:
        old = self._by_session.get(session_id)
        if old is not None:
            self._drop(old)
        while len(self._by_id) >= self.max_exports:
            self._drop(min(self._by_id.values(), key=lambda j: j.order))
        job = _Export(secrets.token_urlsafe(18), session_id, session_closed, asyncio.create_task(build()))
        job.task.add_done_callback(_retrieve)
        self._by_session[session_id] = job
        self._by_id[job.export_id] = job
        return job

    def _drop(self, job: _Export) -> None:
        if self._by_session.get(job.session_id) is job:
            del self._by_session[job.session_id]
        self._by_id.pop(job.export_id, None)
        if not job.task.done():
            job.task.cancel()

    def _forget_expired(self) -> None:
        now = time.time()
        for job in [j for j in self._by_id.values() if j.task.done() and max(j.keep_until, j.started + self.url_seconds) < now]:
            self._drop(job)

    def _sign(self, export_id: str, expires: int) -> str:
        return hmac.new(self._key, f"{export_id}:{expires}".encode(), hashlib.sha256).hexdigest()

    def _signed_path(self, job: _Export) -> str:
        expires = int(time.time() + self.url_seconds)
        job.keep_until = max(job.keep_until, expires)  # kept as long as a URL naming it is valid
        return f"/api/v1/trace_exports/{job.export_id}?expires={expires}&signature={self._sign(job.export_id, expires)}"


def _retrieve(task: asyncio.Task) -> None:
    """A build's failure is answered to the poll that finds it; retrieved here so an export nobody
    polls again logs no "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()
