"""Anthropic Messages shapes (``POST /v1/messages``, as Tinker's beta has it) <-> Temper's Sample.
Pure functions: no network, no state.

Request: ``model``, ``max_tokens`` (required), ``messages`` (user / assistant turns, a string or text
and image blocks, images as base64 sources; a last assistant turn is continued, as Anthropic prefills),
``system`` (text), ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``, ``stream``; ``metadata`` is
accepted. What Temper cannot do (tools, documents, image URLs, extended thinking) is refused with a 400,
never ignored.
Answer: a ``message`` with one text block, ``stop_reason`` (end_turn, max_tokens, stop_sequence) and
``usage``; streamed, Anthropic's event sequence. Errors: ``{"type": "error", "error": {type, message}}``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from temper.services.gateway import fields, image_parts
from temper.services.gateway import openai_convert as oc
from temper.services.gateway.errors import GatewayError, bounded, http_status, invalid

MAX_STOP_SEQUENCES = oc.MAX_STOP
_REFUSED = ("tools", "tool_choice")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 504: "timeout_error"}


def generation(body: Mapping[str, Any]) -> oc.Generation:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: required, a base model (GET /v1/models) or a tinker://…/sampler_weights/… path")
    max_tokens = fields.integer(body, "max_tokens", 1, fields.INT32[1])  # required
    for name in _REFUSED:
        if body.get(name) not in (None, [], {}):
            raise invalid(f"{name}: tool use is not supported by Temper")
    thinking = body.get("thinking")
    if thinking not in (None, {}) and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise invalid("thinking: extended thinking is not supported by Temper")
    if body.get("metadata") is not None and not isinstance(body.get("metadata"), dict):
        raise invalid("metadata: must be an object")
    stop = body.get("stop_sequences")
    stop = [] if stop is None else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in stop):
        raise invalid(f"stop_sequences: a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
    temperature = fields.number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = fields.number(body, "top_p", 0.0, 1.0, 1.0)
    top_k = fields.integer(body, "top_k", -1, fields.INT32[1], -1)
    return oc.Generation(model=model, n=1, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         stop=tuple(stop), stream=fields.boolean(body, "stream"))


def _text(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """Text blocks joined into one string; with ``image`` blocks (``images``: a message's content, base64
    sources only), the blocks in order as text and image parts (chat_prompt.py renders them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: a string or a list of text{' and image' if images else ''} blocks")
    parts: list[dict] = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and images:
            parts.append({"type": "image", "image": image_parts.anthropic_image(block, f"{where}[{i}]")})
        else:
            allowed = "text and image blocks" if images else "text blocks"
            raise invalid(f"{where}[{i}]: only {allowed} are supported by Temper, got {kind!r}")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_messages(body: Mapping[str, Any]) -> tuple[list[dict], bool]:
    """The chat-template messages (system first when given) and whether the last one, an assistant
    turn, is to be continued."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty list of {role, content}")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role: user or assistant")
        out.append({"role": message["role"], "content": _text(message.get("content"), f"messages[{i}].content", images=True)})
    return out, out[-1]["role"] == "assistant"


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn" if finish_reason == "stop" else "max_tokens"


def message(message_id: str, model: str, text: str, reason: str | None, stop_sequence: str | None, input_tokens: int,
            output_tokens: int) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}] if reason is not None else [],
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def error_body(error: GatewayError) -> tuple[int, dict]:
    status = http_status(error)
    kind = _ERROR_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": bounded(error.message)}}
