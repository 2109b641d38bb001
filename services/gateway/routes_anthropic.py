"""Anthropic-compatible ``POST /v1/messages`` (Tinker has it in beta), beside the OpenAI routes and on
the same machinery: the model resolved per API key (openai_targets.py), the model's chat template,
one Sample (or, with ``stream: true``, SampleStream, its events sent as the tokens are decoded). The
key comes as ``x-api-key`` (Anthropic's client) or ``Authorization: Bearer``; ``anthropic-version`` is
accepted whatever it says. Shapes in anthropic_convert.py; errors in Anthropic's shape (app.py answers
the ones no route reaches the same way).
"""

from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from temper.services.gateway import anthropic_convert as ac
from temper.services.gateway import chat_prompt
from temper.services.gateway.app import api_key, gateway, image_limits, json_body
from temper.services.gateway.chat_prompt import ChatPrompt
from temper.services.gateway.detokenize import TextStream
from temper.services.gateway.errors import GatewayError, http_headers, request_error
from temper.services.gateway.openai_stream import SSE_HEADERS
from temper.services.gateway.openai_targets import ModelNotFound, Target
from temper.services.gateway.routes_openai import sample_request, targets
from temper.services.gateway.sample_stream import open_deltas
from temper.common.codec import decode_tokens
from temper.v1 import types_pb2

log = logging.getLogger("temper.gateway")
router = APIRouter()


def anthropic_error(error: GatewayError) -> JSONResponse:
    status, body = ac.error_body(error)
    return JSONResponse(body, status_code=status, headers=http_headers(status))


def _prompt(request: Request, target: Target, messages: list[dict], continued: bool) -> list[int] | ChatPrompt:
    return chat_prompt.render(target.chat_model(), messages, continued, image_limits(request))


async def messages(request: Request):
    try:
        api_key(request)
        body = await json_body(request)
        gen = ac.generation(body)
        chat, continued = ac.chat_messages(body)
        return await (_streamed if gen.stream else _whole)(request, gen, chat, continued)
    except ModelNotFound as error:
        return anthropic_error(GatewayError(error.code, f"model: {error.model}: {error.message}"))
    except Exception as exc:  # noqa: BLE001 - answered in Anthropic's shape
        error = request_error(exc)
        log.info("%s %s -> %s", request.method, request.url.path, error)
        return anthropic_error(error)


async def _whole(request: Request, gen, chat: list[dict], continued: bool) -> dict:
    scheduler, key = gateway(request).scheduler, api_key(request)

    async def use(target: Target):
        prompt = _prompt(request, target, chat, continued)
        sample, _ = sample_request(target, gen, prompt)
        return prompt, await scheduler.verb("Sample", sample, key)

    target, (prompt, resp) = await targets(request).call(gen.model, key, use)
    seq = resp.sequences[0]
    tokens = decode_tokens(seq.tokens).tolist()
    text = TextStream(target.tokenizer, gen.stop)  # the same cut as the streamed answer's
    whole = text.push(tokens) + text.finish()
    finish = "stop" if text.stopped is not None or seq.stop_reason == types_pb2.STOP_REASON_STOP else "length"
    return ac.message(f"msg_{uuid.uuid4().hex}", gen.model, whole, ac.stop_reason(finish, text.stopped), text.stopped,
                      len(prompt), len(tokens))


async def _streamed(request: Request, gen, chat: list[dict], continued: bool) -> StreamingResponse:
    scheduler, key = gateway(request).scheduler, api_key(request)

    async def use(target: Target):
        prompt = _prompt(request, target, chat, continued)
        sample, _ = sample_request(target, gen, prompt)
        return prompt, await open_deltas(scheduler, key, sample, target.tokenizer, gen.stop)

    _, (prompt, stream) = await targets(request).call(gen.model, key, use)
    return StreamingResponse(_events(stream, gen, len(prompt)), media_type="text/event-stream", headers=SSE_HEADERS)


async def _events(stream, gen, input_tokens: int):
    """message_start, content_block_start, content_block_delta..., content_block_stop, message_delta, message_stop."""
    message_id = f"msg_{uuid.uuid4().hex}"
    output_tokens, reason, stop_sequence = 0, None, None
    try:
        yield ac.event("message_start", {"message": ac.message(message_id, gen.model, "", None, None, input_tokens, 0)})
        yield ac.event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        async for deltas in stream:
            for d in deltas:
                output_tokens += len(d.tokens)
                if d.text:
                    yield ac.event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": d.text}})
                if d.finish_reason is not None:
                    reason, stop_sequence = ac.stop_reason(d.finish_reason, d.stop_sequence), d.stop_sequence
        yield ac.event("content_block_stop", {"index": 0})
        yield ac.event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                         "usage": {"output_tokens": output_tokens}})
        yield ac.event("message_stop", {})
    except Exception as exc:  # noqa: BLE001 - the status line is gone: Anthropic's error event
        error = GatewayError.of(exc)
        if not isinstance(exc, GatewayError):
            log.exception("stream failed")
        yield ac.event("error", {"error": ac.error_body(error)[1]["error"]})
    finally:
        await stream.aclose()


for prefix in ("/v1", "/oai/api/v1"):
    router.add_api_route(f"{prefix}/messages", messages, methods=["POST"])
