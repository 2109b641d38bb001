"""OpenAI's server-sent events for ``stream: true``, made from the deltas of streamed sampling
(sample_stream.py) as they arrive: each event is sent as its tokens are decoded.

Completions: one ``text_completion`` chunk per delta (choice index ``prompt * n + sequence``), with
its logprobs when asked. Chat: a first chunk per choice with the assistant role, then
``chat.completion.chunk`` deltas of content; each choice's last one carries its ``finish_reason``.
``stream_options.include_usage`` adds a last chunk with the usage (the others have ``usage: null``).
A failure after the events began is sent as an event ``{"error": {...}}`` (OpenAI's client raises it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from temper.services.gateway import openai_convert as oc
from temper.services.gateway.errors import GatewayError
from temper.services.gateway.sample_stream import Delta

log = logging.getLogger("temper.gateway")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def merged(streams: list[AsyncIterator[list[Delta]]]) -> AsyncIterator[tuple[int, list[Delta]]]:
    """(stream number, deltas) from several streams, in the order they arrive."""
    if len(streams) == 1:
        async for deltas in streams[0]:
            yield 0, deltas
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream):
        try:
            async for deltas in stream:
                await queue.put((i, deltas))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


async def _guarded(events: AsyncIterator[str], streams: list) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - the status line is gone: the error becomes an event
        error = GatewayError.of(exc)
        if not isinstance(exc, GatewayError):
            log.exception("stream failed")
        yield _event(oc.error_body(error)[1])
    finally:
        for stream in streams:
            await stream.aclose()


def completion_events(streams: list, gen: oc.Generation, head: dict, tokenizer: Any, prompt_tokens: int) -> AsyncIterator[str]:
    return _guarded(_completion_events(streams, gen, {**head, "object": "text_completion"}, tokenizer, prompt_tokens), streams)


async def _completion_events(streams, gen, head, tokenizer, prompt_tokens):
    generated, offsets = 0, {}
    async for i, deltas in merged(streams):
        for d in deltas:
            index = i * gen.n + d.index
            generated += len(d.tokens)
            logprobs = None
            if gen.logprobs is not None:
                logprobs = oc.completion_logprobs(tokenizer, oc.Choice(d.text, "", d.tokens, d.logprobs, d.topk), gen.logprobs)
                base = offsets.get(index, 0)
                logprobs["text_offset"] = [base + at for at in logprobs["text_offset"]]
                offsets[index] = base + sum(len(t) for t in logprobs["tokens"])
            if d.text or d.finish_reason or logprobs:
                choice = {"index": index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
                yield _event({**head, "choices": [choice], **({"usage": None} if gen.include_usage else {})})
    if gen.include_usage:
        yield _event({**head, "choices": [], "usage": oc.usage(prompt_tokens, generated)})
    yield "data: [DONE]\n\n"


def chat_events(stream, gen: oc.Generation, head: dict, tokenizer: Any, prompt_tokens: int) -> AsyncIterator[str]:
    return _guarded(_chat_events(stream, gen, {**head, "object": "chat.completion.chunk"}, tokenizer, prompt_tokens), [stream])


async def _chat_events(stream, gen, head, tokenizer, prompt_tokens):
    usage = {"usage": None} if gen.include_usage else {}
    for j in range(gen.n):
        yield _event({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                           "finish_reason": None}], **usage})
    generated = 0
    async for d in _each(stream):
        generated += len(d.tokens)
        logprobs = None
        if gen.logprobs is not None:
            logprobs = oc.chat_logprobs(tokenizer, oc.Choice(d.text, "", d.tokens, d.logprobs, d.topk), gen.logprobs)
        if d.text or d.finish_reason or logprobs:
            delta = {"content": d.text} if d.text else {}
            yield _event({**head, "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": d.finish_reason}], **usage})
    if gen.include_usage:
        yield _event({**head, "choices": [], "usage": oc.usage(prompt_tokens, generated)})
    yield "data: [DONE]\n\n"


async def _each(stream) -> AsyncIterator[Delta]:
    async for deltas in stream:
        for d in deltas:
            yield d
