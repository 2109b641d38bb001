"""Log set-up: request context on every line logged inside it, in text and in JSON."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from temper.common.logs import configure_logging, request_context


def capture(fmt: str) -> io.StringIO:
    configure_logging("INFO", fmt)
    stream = io.StringIO()
    logging.getLogger().handlers[0].setStream(stream)
    return stream


def test_text_lines_carry_the_request_context_across_tasks_and_threads():
    stream = capture("text")

    async def main():
        with request_context(run="s:train:0", seq=7, tenant="alice"):
            await asyncio.to_thread(logging.getLogger("temper.x").info, "admitted")
        logging.getLogger("temper.x").info("outside")

    asyncio.run(main())
    first, second = stream.getvalue().splitlines()
    assert first.endswith("temper.x: admitted [run=s:train:0 seq=7 tenant=alice]")
    assert second.endswith("temper.x: outside")


def test_json_lines_are_objects_with_the_context_as_fields():
    stream = capture("json")
    with request_context(run="r", seq=3):
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("temper.y").exception("cycle failed")
    entry = json.loads(stream.getvalue())
    assert (entry["level"], entry["logger"], entry["message"], entry["run"], entry["seq"]) == ("ERROR", "temper.y", "cycle failed", "r", 3)
    assert "ValueError: boom" in entry["exception"]
    configure_logging("INFO", "text")
