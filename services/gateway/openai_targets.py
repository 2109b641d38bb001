"""What the OpenAI routes sample with: an OpenAI ``model`` resolved, per API key, to a Temper sampling
client, plus the base model's tokenizer (for chat templates and decoding), context length and, for a
vision-language model, its image token ids and processor (chat images): read from the model's folder
when it is on this machine, else from the scheduler's capabilities (SupportedModel.vision).

OpenAI requests carry no session, so the gateway opens one session per API key (tag ``openai``) and
one sampling client per (key, model), and reuses them; a sampling client that stops answering
(its session closed, its checkpoint gone) is made again once. The tokenizer comes from the
scheduler (GetTokenizer, cached on disk as temper.client caches it), or from the folder the
scheduler names when that folder exists on this machine.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import grpc

from temper.services.gateway.chat_prompt import ChatModel
from temper.services.gateway.errors import GatewayError, invalid
from temper.services.gateway.openai_convert import model_source
from temper.services.gateway.upstream import Scheduler
from temper.services.models.images import VisionProcessor
from temper.v1 import service_pb2

MAX_SAMPLERS = 10_000
DEFAULT_CONTEXT = 2048  # when the scheduler does not list the model's context length
T = TypeVar("T")


class ModelNotFound(GatewayError):
    """The scheduler knows no such base model or checkpoint (for the caller): OpenAI's model_not_found."""

    def __init__(self, model: str, error: GatewayError):
        super().__init__(error.code, error.message)
        self.model = model


@dataclass
class Target:
    sampler_id: str
    base_model: str
    tokenizer: Any
    max_context_length: int
    vision: VisionProcessor | None = None
    no_vision: str = "it is a text-only model"  # why ``vision`` is None

    def chat_model(self) -> ChatModel:
        return ChatModel(self.base_model, self.tokenizer, self.vision, self.no_vision)


@dataclass
class _Model:
    tokenizer: Any
    max_context_length: int
    vision: VisionProcessor | None = None
    no_vision: str = "it is a text-only model"


class _Fetched:
    """The chunks of one GetTokenizer call, shaped as the runtime temper.client's fetch reads them from."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    def stream(self, method: str, request: Any) -> "_Fetched":
        return self

    def result(self) -> list:
        return self.chunks


class Targets:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._sessions: dict[str, str] = {}
        self._samplers: "OrderedDict[tuple[str, str], service_pb2.SamplingClientInfo]" = OrderedDict()
        self._models: dict[str, _Model] = {}
        self._locks: dict[Any, asyncio.Lock] = {}

    def _lock(self, name: Any) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def call(self, model: str, key: str, use: Callable[[Target], Awaitable[T]]) -> tuple[Target, T]:
        """``use(target)`` on the sampling client of (key, model); made again once if a reused one
        fails as gone (NOT_FOUND, FAILED_PRECONDITION)."""
        ident = (_digest(key), model)
        reused = ident in self._samplers
        target = await self.resolve(model, key)
        try:
            return target, await use(target)
        except GatewayError as error:
            self._samplers.pop(ident, None)
            if not reused or error.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise
            self._sessions.pop(ident[0], None)
        target = await self.resolve(model, key)
        return target, await use(target)

    async def resolve(self, model: str, key: str) -> Target:
        """The sampling client and model of ``model`` for ``key``; an unknown model raises NOT_FOUND
        (or INVALID_ARGUMENT for a malformed path) from the scheduler."""
        ident = (_digest(key), model)
        async with self._lock(ident):
            info = self._samplers.get(ident)
            if info is None:
                info = await self._create(model, key)
                self._samplers[ident] = info
                while len(self._samplers) > MAX_SAMPLERS:
                    self._samplers.popitem(last=False)
            self._samplers.move_to_end(ident)
        found = await self.model(info.base_model, info.tokenizer_id, key)
        return Target(info.sampler_id, info.base_model, found.tokenizer, found.max_context_length, found.vision,
                      found.no_vision)

    async def _create(self, model: str, key: str) -> service_pb2.SamplingClientInfo:
        kind, value, expected_base = model_source(model)
        request = service_pb2.CreateSamplingClientRequest(session_id=await self._session(key), **{kind: value})
        try:
            info = await self.scheduler.call("CreateSamplingClient", request, key)
        except GatewayError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:
                raise ModelNotFound(model, error) from None
            raise
        if expected_base is not None and info.base_model != expected_base:
            raise invalid(f"{value} was trained on {info.base_model!r}, not {expected_base!r}")
        return info

    async def _session(self, key: str) -> str:
        digest = _digest(key)
        async with self._lock(("session", digest)):
            if digest not in self._sessions:
                session = await self.scheduler.call("CreateSession", service_pb2.CreateSessionRequest(tags=["openai"]), key)
                self._sessions[digest] = session.session_id
            return self._sessions[digest]

    async def model(self, base_model: str, tokenizer_id: str, key: str) -> _Model:
        async with self._lock(("model", base_model)):
            if base_model not in self._models:
                tokenizer = await self._tokenizer(base_model, tokenizer_id, key)
                described = await self._described(base_model, key)
                vision, no_vision = await asyncio.to_thread(vision_of, tokenizer_id, described)
                self._models[base_model] = _Model(tokenizer, _context_length(described, tokenizer), vision, no_vision)
            return self._models[base_model]

    async def _tokenizer(self, base_model: str, tokenizer_id: str, key: str) -> Any:
        from transformers import AutoTokenizer

        from temper.client.tokenizer import COMPLETE, cache_folder, fetch_tokenizer_files

        source = tokenizer_id
        if not (tokenizer_id and os.path.isdir(tokenizer_id)):
            folder = cache_folder(base_model, tokenizer_id)
            source = str(folder)
            if not (folder / COMPLETE).exists():
                try:
                    chunks = await self.scheduler.stream("GetTokenizer", service_pb2.GetTokenizerRequest(base_model=base_model), key)
                    await asyncio.to_thread(fetch_tokenizer_files, _Fetched(chunks), base_model, folder)
                except GatewayError as error:
                    if error.code != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    source = tokenizer_id or base_model  # a scheduler without GetTokenizer: the hub id
        return await asyncio.to_thread(AutoTokenizer.from_pretrained, source)

    async def _described(self, base_model: str, key: str) -> service_pb2.SupportedModel | None:
        """The scheduler's description of ``base_model`` (GetServerCapabilities); None if it lists none."""
        caps = await self.scheduler.call("GetServerCapabilities", service_pb2.GetServerCapabilitiesRequest(), key)
        return next((m for m in caps.supported_models if m.model_name == base_model), None)


def _context_length(described: service_pb2.SupportedModel | None, tokenizer: Any) -> int:
    if described is not None and described.max_context_length > 0:
        return int(described.max_context_length)
    limit = getattr(tokenizer, "model_max_length", 0) or 0
    return int(limit) if 0 < limit < 1_000_000 else DEFAULT_CONTEXT


def vision_of(folder: str, described: service_pb2.SupportedModel | None = None) -> tuple[VisionProcessor | None, str]:
    """The model's image token ids and processor (images.VisionProcessor), else None and why. From its
    config.json and preprocessor_config.json when its folder is on this machine; otherwise from the
    scheduler's description of it (``described``: SupportedModel.vision, as its workers report it), so a
    gateway on another machine (docker-compose) counts and checks images as the workers will."""
    if folder and os.path.isfile(os.path.join(folder, "config.json")):
        from transformers import AutoConfig

        return VisionProcessor.from_model(AutoConfig.from_pretrained(folder), folder), "it is a text-only model"
    if described is None:
        return None, "the scheduler does not describe this model and its folder is not on this machine, so the gateway " \
                     "cannot count its image tokens"
    vision = VisionProcessor.from_info(described.vision) if described.HasField("vision") else None
    return vision, "it is a text-only model"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
