"""OpenAI request and response shapes <-> Temper's Sample call. Pure functions: no network, no state.

Covers what /v1/completions and /v1/chat/completions need (routes_openai.py): the sampling fields
(``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``n``, ``seed``, ``logprobs``,
``top_logprobs``, ``echo``), the answer with ``usage``, the server-sent events of ``stream=true``
(all at once: the gRPC Sample answers whole), and OpenAI's error shape. Fields that change the
distribution and that Temper cannot apply (penalties, ``logit_bias``, ``best_of``, tools) are refused
with a 400, never ignored. Decoding takes any tokenizer with ``decode`` (transformers' in practice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import grpc
import numpy as np

from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_tokens
from temper.common.strings import shown
from temper.services.gateway import fields, image_parts
from temper.services.gateway.errors import GatewayError, bounded, http_status, invalid
from temper.v1 import types_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /completions; chat defaults to the context left
MAX_N = 128
MAX_COMPLETION_LOGPROBS = 20
MAX_STOP = 4
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None, "suffix": None,
            "tools": None, "functions": None, "tool_choice": None, "function_call": None}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}


@dataclass
class Generation:
    """What an OpenAI request asks of Sample, whichever route it came by."""

    model: str
    n: int = 1
    max_tokens: int | None = None   # None (chat): as many as the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None     # None: none; k >= 0: the chosen tokens' logprobs and k alternatives
    echo: bool = False              # completions only: the prompt (and its logprobs) ahead of the text
    stream: bool = False
    include_usage: bool = False     # stream_options.include_usage


def _number(body: Mapping[str, Any], name: str, default, kind=float):
    """An OpenAI number field, bounded by the Sample field it goes into (int32, or int64 for seed)."""
    if kind is float:
        return fields.number(body, name, -fields.FLOAT32_MAX, fields.FLOAT32_MAX, default)
    lo, hi = fields.INT64 if name == "seed" else fields.INT32
    return fields.integer(body, name, lo, hi, default)


def generation(body: Mapping[str, Any], chat: bool) -> Generation:
    """The sampling fields of a request body; refuses what Temper cannot honour."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: a base model (GET /v1/models) or a tinker://…/sampler_weights/… path")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and not (neutral is None and value in ({}, [], "", "none")):
            raise invalid(f"'{name}' is not supported by Temper")
    if fields.string(fields.obj(body, "response_format", {}), "type", default="text", where="response_format.") != "text":
        raise invalid("'response_format' other than text is not supported by Temper")
    n = _number(body, "n", 1, int)
    if body.get("best_of") not in (None, n):
        raise invalid("'best_of' is not supported by Temper")
    if not 1 <= n <= MAX_N:
        raise invalid(f"'n' must be in [1, {MAX_N}], got {n}")
    max_tokens = _number(body, "max_completion_tokens", None, int) if chat else None
    max_tokens = _number(body, "max_tokens", max_tokens, int)
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_tokens < (0 if fields.boolean(body, "echo") else 1):
        raise invalid(f"'max_tokens' must be at least 1, got {max_tokens}")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise invalid(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them")
    if chat:
        if fields.boolean(body, "echo"):
            raise invalid("'echo' is for /v1/completions")
        top = _number(body, "top_logprobs", 0, int)
        logprobs = top if fields.boolean(body, "logprobs") else None
        if top and logprobs is None:
            raise invalid("'top_logprobs' needs 'logprobs': true")
    else:
        logprobs = _number(body, "logprobs", None, int)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"logprobs alternatives must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}")
    seed = _number(body, "seed", None, int)
    return Generation(
        model=model, n=n, max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", -1, int), seed=seed, stop=tuple(stop),
        logprobs=logprobs, echo=fields.boolean(body, "echo"), stream=fields.boolean(body, "stream"),
        include_usage=fields.boolean(fields.obj(body, "stream_options", {}), "include_usage", where="stream_options."))


def model_source(model: str) -> tuple[str, str, str | None]:
    """``model`` -> (kind, value, expected base model): ("model_path", "tinker://…", None) for a
    checkpoint, ("base_model", name, None) for a base model, and for Tinker's
    ``<base model>;<checkpoint path>`` the checkpoint with the base model it must be on."""
    base, sep, path = model.partition(";")
    if sep:
        return "model_path", path.strip(), base.strip()
    return ("model_path" if model.startswith("tinker://") else "base_model"), model, None


def completion_prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(fields.is_integer(p) for p in prompt):
            return [fields.integers(prompt, "'prompt' token ids", 0, fields.INT32[1])]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(fields.is_integer(t) for t in p) for p in prompt):
            return [fields.integers(p, "'prompt' token ids", 0, fields.INT32[1]) for p in prompt]
    raise invalid("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists (not empty)")


def _content_parts(content: list, where: str) -> str | list[dict]:
    """Text parts joined into one string; with ``image_url`` parts (data: URLs only), the parts in
    order, each image unwrapped (chat_prompt.py renders them)."""
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            parts.append({"type": "image", "image": image_parts.openai_image(part, f"{where}[{j}]")})
        else:
            raise invalid(f"{where}[{j}]: only text and image_url parts are supported by Temper")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_messages(body: Mapping[str, Any]) -> list[dict]:
    """``messages`` as the chat template takes them: role and content, text parts joined into a
    string unless the message has images (then a list of text and image parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):
            content = _content_parts(content, f"messages[{i}].content")
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text and image_url parts")
        if message.get("tool_calls"):
            raise invalid(f"messages[{i}]: tool calls are not supported by Temper")
        out.append({"role": message["role"], "content": content})
    return out


def sampling_params(gen: Generation, max_tokens: int, eos_ids: Iterable[int] = ()) -> types_pb2.SamplingParams:
    """The Sample call's parameters. Stop strings replace the model's default stop in Temper, so the
    end-of-sequence ids come along as stop tokens (OpenAI always stops there)."""
    params = types_pb2.SamplingParams(max_tokens=max_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                      top_k=max(gen.top_k, 0))
    if gen.seed is not None:
        params.seed = gen.seed
    if gen.stop:
        params.stop_strings.extend(gen.stop)
        params.stop_token_ids = encode_tokens(sorted(set(eos_ids)))
    return params


# ---- answers ------------------------------------------------------------------------------------------

@dataclass
class Choice:
    """One generated sequence, decoded."""

    text: str
    finish_reason: str  # "stop" | "length"
    tokens: list[int]
    logprobs: list[float]
    topk: list[list[tuple[int, float]]] | None  # per token: the k most likely (id, logprob)


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    cuts = [text.find(s) for s in stop if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def choices_of(resp: types_pb2.SampleResponse, tokenizer, stop: tuple[str, ...]) -> list[Choice]:
    """Each sequence's text without special tokens and cut before the first stop string (OpenAI
    leaves the stop sequence out); tokens and logprobs stay whole."""
    out = []
    for s in resp.sequences:
        tokens = decode_tokens(s.tokens).tolist()
        text, cut = _cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop)
        topk = None
        if s.topk:
            ids = decode_tokens(s.topk_token_ids).reshape(-1, s.topk).tolist()
            lps = decode_floats(s.topk_logprobs).reshape(-1, s.topk).tolist()
            topk = [list(zip(i, lp)) for i, lp in zip(ids, lps)]
        reason = "stop" if cut or s.stop_reason == types_pb2.STOP_REASON_STOP else "length"
        out.append(Choice(text, reason, tokens, decode_floats(s.logprobs).tolist(), topk))
    return out


def prompt_logprobs(resp: types_pb2.SampleResponse) -> list[float | None]:
    if not resp.HasField("prompt_logprobs"):
        return []
    values = decode_array(resp.prompt_logprobs).astype(np.float32).reshape(-1)
    return [None if np.isnan(v) else float(v) for v in values]


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, choice: Choice, k: int, prompt: list[int] | None = None,
                        prompt_lps: list[float | None] | None = None) -> dict:
    """The legacy completions ``logprobs`` object; with ``echo`` the prompt's tokens come first (their
    alternatives are not computed: None)."""
    tokens, lps, tops = [], [], []
    for tok, lp in zip(prompt or [], prompt_lps or []):
        tokens.append(_piece(tokenizer, tok))
        lps.append(lp)
        tops.append(None)
    for i, (tok, lp) in enumerate(zip(choice.tokens, choice.logprobs)):
        tokens.append(_piece(tokenizer, tok))
        lps.append(lp)
        top: dict[str, float] | None = None
        if k:
            top = {}
            for t, v in (choice.topk[i] if choice.topk else [])[:k]:
                top.setdefault(_piece(tokenizer, t), v)  # two ids may decode alike: the likelier one stays
        tops.append(top)
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if k or prompt else None, "text_offset": offsets}


def chat_logprobs(tokenizer, choice: Choice, k: int) -> dict:
    def entry(tok: int, lp: float) -> dict:
        piece = _piece(tokenizer, tok)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

    content = []
    for i, (tok, lp) in enumerate(zip(choice.tokens, choice.logprobs)):
        alternatives = (choice.topk[i][:k] if choice.topk and k else [])
        content.append({**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in alternatives]})
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use, "system_fingerprint": None}


def chat_body(request_id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use, "system_fingerprint": None}


def chat_choice(index: int, choice: Choice, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": logprobs, "finish_reason": choice.finish_reason}


def stream_events(body: dict, chat: bool, include_usage: bool) -> Iterator[str]:
    """A whole answer as the server-sent events of ``stream=true``: one chunk per choice carrying all
    its text, an optional usage chunk, then ``[DONE]``."""
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    for choice in body["choices"]:
        if chat:
            item = {"index": choice["index"], "delta": {"role": "assistant", "content": choice["message"]["content"]},
                    "logprobs": choice["logprobs"], "finish_reason": choice["finish_reason"]}
        else:
            item = choice
        yield _event({**head, "choices": [item], **({"usage": None} if include_usage else {})})
    if include_usage:
        yield _event({**head, "choices": [], "usage": body["usage"]})
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---- errors -------------------------------------------------------------------------------------------

def error_body(error: GatewayError, param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    """(HTTP status, OpenAI's ``{"error": {message, type, param, code}}``); the status as the Tinker
    routes answer it (errors.py), so the OpenAI client retries exactly the transient ones."""
    status = http_status(error)
    kind = _TYPES.get(status, "server_error")
    if code is None:
        code = {grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key", grpc.StatusCode.UNIMPLEMENTED: "unsupported"}.get(error.code)
    return status, {"error": {"message": bounded(error.message), "type": kind, "param": param, "code": code}}


def model_not_found(model: str, error: GatewayError) -> tuple[int, dict]:
    wrapped = GatewayError(grpc.StatusCode.NOT_FOUND, f"The model {shown(model)} does not exist or you do not have access "
                                                      f"to it ({error.message})")
    status, body = error_body(wrapped, "model", "model_not_found")
    body["error"]["type"] = "invalid_request_error"  # as OpenAI answers an unknown model
    return status, body
