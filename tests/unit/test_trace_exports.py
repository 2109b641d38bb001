"""The trace export jobs behind the SDK's export_session_trace (services/gateway/console/trace_exports.py):
the polling protocol (pending until built, then ready with a signed URL; failed with the build's
message), reuse only of an up-to-date export, and the signed URL's checks (tampered, expired, not kept).
Builds are gated by events, never by timing: the polls here wait 0 s for a build."""

import asyncio
from urllib.parse import parse_qs, urlsplit

import grpc
import pytest

from temper.services.gateway.console.trace_exports import TraceExports
from temper.services.gateway.errors import GatewayError


def gated(body: bytes, counter: list):
    """A build that waits for its gate; ``counter`` counts builds started."""
    gate = asyncio.Event()

    async def build():
        counter.append(1)
        await gate.wait()
        return body
    return gate, build


def url_parts(url: str) -> tuple[str, str, str]:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    return parts.path.rsplit("/", 1)[1], query["expires"][0], query["signature"][0]


def test_pending_until_built_then_ready_with_a_url_that_downloads_the_file():
    async def main():
        exports, builds = TraceExports(first_wait_seconds=0), []
        gate, build = gated(b'{"traceEvents": []}', builds)
        assert await exports.poll("s1", False, build) == {"status": "pending", "url": None, "error": None}
        assert await exports.poll("s1", False, build) == {"status": "pending", "url": None, "error": None}
        assert len(builds) == 1  # a poll while building joins the build
        gate.set()
        await asyncio.sleep(0)
        answer = await exports.poll("s1", False, build)
        assert answer["status"] == "ready" and answer["url"].startswith("/api/v1/trace_exports/")
        job, body = exports.download(*url_parts(answer["url"]))
        assert body == b'{"traceEvents": []}' and job.session_id == "s1"
        return exports, answer["url"]
    asyncio.run(main())


def test_a_closed_sessions_export_is_reused_an_open_ones_is_rebuilt():
    async def main():
        exports, builds = TraceExports(first_wait_seconds=5), []
        done = asyncio.Event()
        done.set()

        async def build():
            builds.append(1)
            await done.wait()
            return b"{}"
        first = await exports.poll("open", False, build)
        second = await exports.poll("open", False, build)
        assert first["status"] == second["status"] == "ready" and len(builds) == 2
        assert url_parts(first["url"])[0] != url_parts(second["url"])[0]
        with pytest.raises(GatewayError) as gone:  # the rebuild replaced the first export
            exports.download(*url_parts(first["url"]))
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        a = await exports.poll("closed", True, build)
        b = await exports.poll("closed", True, build)
        assert len(builds) == 3 and url_parts(a["url"])[0] == url_parts(b["url"])[0]
    asyncio.run(main())


def test_a_failed_build_answers_failed_with_its_message_and_the_next_export_retries():
    async def main():
        exports, calls = TraceExports(first_wait_seconds=5), []

        async def too_large():
            calls.append(1)
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "the range holds more than 3 requests and samples")
        answer = await exports.poll("s", False, too_large)
        assert answer == {"status": "failed", "url": None, "error": "the range holds more than 3 requests and samples"}
        assert (await exports.poll("s", False, too_large))["status"] == "failed" and len(calls) == 2
    asyncio.run(main())


def test_tampered_expired_and_unknown_urls_are_refused():
    async def main():
        exports = TraceExports(first_wait_seconds=5)

        async def build():
            return b"{}"
        export_id, expires, signature = url_parts((await exports.poll("s", True, build))["url"])
        cases = [(export_id, expires, signature[:-1] + ("0" if signature[-1] != "0" else "1"), 403),
                 (export_id, str(int(expires) + 1), signature, 403),
                 (export_id[:-1] + ("x" if export_id[-1] != "x" else "y"), expires, signature, 403),  # the signature covers the id
                 (export_id, "soon", signature, 403)]
        for case in cases:
            with pytest.raises(GatewayError) as refused:
                exports.download(*case[:3])
            assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED, case
        # a correctly signed URL whose time has passed: signed here for a past expiry
        past = "1000"
        with pytest.raises(GatewayError) as expired:
            exports.download(export_id, past, exports._sign(export_id, 1000))
        assert "expired" in expired.value.message
        other = TraceExports()  # another process's key: its URLs do not verify here
        with pytest.raises(GatewayError):
            other.download(export_id, expires, signature)
        exports.download(export_id, expires, signature)  # the untouched URL still works
    asyncio.run(main())


def test_the_oldest_exports_go_when_more_are_kept_than_allowed():
    async def main():
        exports = TraceExports(first_wait_seconds=5, max_exports=2)

        async def build():
            return b"{}"
        urls = [(await exports.poll(f"s{i}", True, build))["url"] for i in range(3)]
        with pytest.raises(GatewayError) as gone:
            exports.download(*url_parts(urls[0]))
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        for url in urls[1:]:
            assert exports.download(*url_parts(url))[1] == b"{}"
    asyncio.run(main())
