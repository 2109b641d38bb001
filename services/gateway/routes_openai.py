"""OpenAI-compatible sampling: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (also
under /oai/api/v1, the path of Tinker's OpenAI-compatible beta).

``model`` is a base model or a sampler checkpoint path (``tinker://<run>/sampler_weights/<name>``;
Tinker's ``<base model>;<path>`` works too). The key is the usual Temper key, as ``Authorization:
Bearer tml-…``, forwarded to the scheduler with every call. Each prompt becomes one Sample call
with ``num_samples=n`` (openai_targets.py resolves the model, openai_convert.py the shapes), so with a
``seed`` the answer is the one temper.client's ``sample`` gives for the same tokens. Chat renders
``messages`` with the model's chat template. Logprobs are log p(token) under the raw model
(temperature 1), as in Temper's Sample. ``stream=true`` is served as server-sent events sent as the
tokens are decoded (SampleStream; openai_stream.py), except with ``echo``, whose prompt logprobs come
with the end. ``GET /v1/models/{id}`` is models.retrieve. Errors use OpenAI's JSON shape, on every
/v1 path (app.py answers the ones no route reaches the same way).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from temper.common.codec import encode_tokens
from temper.services.gateway import chat_prompt
from temper.services.gateway import openai_convert as oc
from temper.services.gateway.app import api_key, gateway, image_limits, json_body
from temper.services.gateway.chat_prompt import ChatPrompt
from temper.services.gateway.errors import GatewayError, http_headers, invalid, request_error
from temper.services.gateway.openai_stream import SSE_HEADERS, chat_events, completion_events
from temper.services.gateway.openai_targets import ModelNotFound, Target, Targets
from temper.services.gateway.sample_stream import open_deltas
from temper.v1 import service_pb2, types_pb2

log = logging.getLogger("temper.gateway")
router = APIRouter()


def targets(request: Request) -> Targets:
    state = request.app.state
    if getattr(state, "openai_targets", None) is None:
        state.openai_targets = Targets(gateway(request).scheduler)
    return state.openai_targets


def _error(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=http_headers(status))


def openai_errors(route):
    """Every failure of an OpenAI route as OpenAI's error JSON; an unknown model as model_not_found."""
    @functools.wraps(route)
    async def wrapper(request: Request):
        try:
            return await route(request)
        except ModelNotFound as error:
            return _error(*oc.model_not_found(error.model, error))
        except Exception as exc:  # noqa: BLE001 - answered in OpenAI's shape
            # as app.py answers the Tinker routes: a shared check's TemperError keeps its code, a
            # malformed body the typed reads missed is 400 (logged with its traceback), the rest 500
            error = request_error(exc)
            log.info("%s %s -> %s", request.method, request.url.path, error)
            return _error(*oc.error_body(error))
    return wrapper


async def _sample(request: Request, gen: oc.Generation, build) -> tuple[Target, list]:
    """``build(target)`` -> the prompts' token lists; one Sample per prompt. Returns the target and,
    per prompt, (tokens, SampleResponse)."""
    scheduler, key = gateway(request).scheduler, api_key(request)

    async def use(target: Target):
        prompts = build(target)
        return await asyncio.gather(*(_sample_one(scheduler, key, target, gen, p) for p in prompts))

    return await targets(request).call(gen.model, key, use)


def sample_request(target: Target, gen: oc.Generation, prompt: list[int] | ChatPrompt) -> tuple[service_pb2.SampleRequest, int]:
    """The Sample call for one prompt (token ids, or a chat's prompt with images; Sample and SampleStream
    alike), and its max_tokens."""
    room = target.max_context_length - len(prompt)
    max_tokens = gen.max_tokens if gen.max_tokens is not None else room
    if max_tokens > room or room < 1:
        raise invalid(f"this model's maximum context length is {target.max_context_length} tokens; the prompt has "
                      f"{len(prompt)} and max_tokens is {max_tokens}")
    eos = [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
    model_input = prompt.model_input if isinstance(prompt, ChatPrompt) else types_pb2.ModelInput(
        chunks=[types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(prompt)))])
    sample = service_pb2.SampleRequest(
        sampler_id=target.sampler_id, prompt=model_input,
        num_samples=gen.n, sampling_params=oc.sampling_params(gen, max(max_tokens, 1), eos),
        include_prompt_logprobs=gen.echo and gen.logprobs is not None, topk_logprobs=gen.logprobs or 0)
    return sample, max_tokens


async def _sample_one(scheduler, key: str, target: Target, gen: oc.Generation, prompt: list[int]):
    sample, max_tokens = sample_request(target, gen, prompt)
    resp = await scheduler.verb("Sample", sample, key)
    if max_tokens == 0:  # echo only (scoring a prompt): the one token sampled to get there is dropped
        for s in resp.sequences:
            s.tokens, s.logprobs, s.topk, s.topk_token_ids, s.topk_logprobs = b"", b"", 0, b"", b""
            s.stop_reason = types_pb2.STOP_REASON_LENGTH
    return prompt, resp


async def _streams(request: Request, gen: oc.Generation, build) -> tuple[Target, list[list[int]], list]:
    """``stream: true``: one SampleStream per prompt, each opened (its first message come) before the
    answer starts, so a refused request is an HTTP error; returns the target, the prompts and their
    delta streams (sample_stream.py)."""
    scheduler, key = gateway(request).scheduler, api_key(request)

    async def use(target: Target):
        prompts = build(target)
        opened = []
        try:
            for prompt in prompts:
                sample, _ = sample_request(target, gen, prompt)
                opened.append(await open_deltas(scheduler, key, sample, target.tokenizer, gen.stop))
        except BaseException:
            for stream in opened:
                await stream.aclose()
            raise
        return prompts, opened

    target, (prompts, streams) = await targets(request).call(gen.model, key, use)
    return target, prompts, streams


def _event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def _head(prefix: str, model: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model, "system_fingerprint": None}


def _respond(body: dict, gen: oc.Generation, chat: bool):
    if gen.stream:
        return StreamingResponse(oc.stream_events(body, chat, gen.include_usage), media_type="text/event-stream")
    return body


@openai_errors
async def completions(request: Request):
    api_key(request)
    body = await json_body(request)
    gen, prompts = oc.generation(body, chat=False), oc.completion_prompts(body)

    def build(target: Target) -> list[list[int]]:
        return [p if isinstance(p, list) else target.tokenizer.encode(p) for p in prompts]

    if gen.stream and not gen.echo:  # echo's prompt logprobs come last: echo streams as one answer
        target, tokens, streams = await _streams(request, gen, build)
        return _event_stream(completion_events(streams, gen, _head("cmpl", gen.model), target.tokenizer,
                                               sum(len(t) for t in tokens)))
    target, results = await _sample(request, gen, build)
    choices, generated = [], 0
    for i, (tokens, resp) in enumerate(results):
        prompt_lps = oc.prompt_logprobs(resp)
        prompt_text = prompts[i] if isinstance(prompts[i], str) else target.tokenizer.decode(tokens)
        for j, choice in enumerate(oc.choices_of(resp, target.tokenizer, gen.stop)):
            generated += len(choice.tokens)
            logprobs = None
            if gen.logprobs is not None:
                logprobs = oc.completion_logprobs(target.tokenizer, choice, gen.logprobs, tokens if gen.echo else None,
                                                  prompt_lps if gen.echo else None)
            choices.append({"index": i * gen.n + j, "text": (prompt_text if gen.echo else "") + choice.text,
                            "logprobs": logprobs, "finish_reason": choice.finish_reason})
    use = oc.usage(sum(len(tokens) for tokens, _ in results), generated)
    return _respond(oc.completion_body(f"cmpl-{uuid.uuid4().hex}", int(time.time()), gen.model, choices, use), gen, False)


@openai_errors
async def chat_completions(request: Request):
    api_key(request)
    body = await json_body(request)
    gen, messages = oc.generation(body, chat=True), oc.chat_messages(body)

    def build(target: Target) -> list[list[int] | ChatPrompt]:
        return [chat_prompt.render(target.chat_model(), messages, limits=image_limits(request))]

    if gen.stream:
        target, [tokens], [stream] = await _streams(request, gen, build)
        return _event_stream(chat_events(stream, gen, _head("chatcmpl", gen.model), target.tokenizer, len(tokens)))
    target, [(tokens, resp)] = await _sample(request, gen, build)
    choices = oc.choices_of(resp, target.tokenizer, gen.stop)
    out = [oc.chat_choice(j, c, oc.chat_logprobs(target.tokenizer, c, gen.logprobs) if gen.logprobs is not None else None)
           for j, c in enumerate(choices)]
    use = oc.usage(len(tokens), sum(len(c.tokens) for c in choices))
    return _respond(oc.chat_body(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), gen.model, out, use), gen, True)


def _model(model_id: str, max_context_length: int, owned_by: str = "temper", **extra) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": owned_by, "max_context_length": max_context_length,
            **extra}


async def _base_models(request: Request) -> dict[str, dict]:
    caps = await gateway(request).scheduler.call("GetServerCapabilities", service_pb2.GetServerCapabilitiesRequest(),
                                                 api_key(request))
    return {m.model_name: _model(m.model_name, m.max_context_length) for m in caps.supported_models if m.sampleable}


@openai_errors
async def models(request: Request):
    return {"object": "list", "data": list((await _base_models(request)).values())}


@openai_errors
async def model(request: Request):
    """OpenAI's models.retrieve: a base model, or a sampler checkpoint the caller may read (its own or
    a published one, as a tinker:// path or Tinker's ``<base model>;<path>``)."""
    model_id = request.path_params["model_id"]
    found = (await _base_models(request)).get(model_id)
    if found is not None:
        return found
    kind, value, expected_base = oc.model_source(model_id)
    if kind != "model_path":
        raise ModelNotFound(model_id, GatewayError(grpc.StatusCode.NOT_FOUND, "not a base model served here"))
    try:
        checkpoint = await gateway(request).scheduler.call("GetCheckpoint", service_pb2.GetCheckpointRequest(path=value),
                                                           api_key(request))
    except GatewayError as error:
        if error.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            raise ModelNotFound(model_id, error) from None
        raise
    if checkpoint.kind != types_pb2.CHECKPOINT_KIND_SAMPLER or expected_base not in (None, checkpoint.base_model):
        raise ModelNotFound(model_id, GatewayError(grpc.StatusCode.NOT_FOUND, "not a sampler checkpoint of that base model"))
    base = (await _base_models(request)).get(checkpoint.base_model, {})
    return _model(model_id, base.get("max_context_length", 0), parent=checkpoint.base_model)


for prefix in ("/v1", "/oai/api/v1"):
    router.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
    router.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route(f"{prefix}/models", models, methods=["GET"])
    router.add_api_route(f"{prefix}/models/{{model_id:path}}", model, methods=["GET"])
