"""The sampler backend interface. The torch backend implements it for CPU/GPU development; an
SGLang backend (its HTTP server with --enable-lora) will implement the same methods."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from temper.common.codec import decode_tokens
from temper.common.errors import InvalidArgument
from temper.v1 import types_pb2


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 16
    seed: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_disabled: bool = False
    processed_logprobs: bool = False

    @classmethod
    def from_proto(cls, p: types_pb2.SamplingParams, vocab_size: int) -> "SamplingOptions":
        if p.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be positive, got {p.max_tokens}")
        if p.temperature < 0 or not np.isfinite(p.temperature):
            raise InvalidArgument(f"temperature must be >= 0, got {p.temperature}")
        if not 0 <= p.top_p <= 1:
            raise InvalidArgument(f"top_p must be in [0, 1], got {p.top_p}")
        stop_ids = tuple(int(t) for t in decode_tokens(p.stop_token_ids))
        if any(t < 0 or t >= vocab_size for t in stop_ids):
            raise InvalidArgument(f"stop token ids must be in [0, {vocab_size})")
        return cls(
            max_tokens=p.max_tokens, seed=p.seed if p.HasField("seed") else None, temperature=p.temperature,
            top_k=max(p.top_k, 0), top_p=p.top_p if 0 < p.top_p < 1 else 1.0, stop_strings=tuple(p.stop_strings),
            stop_token_ids=stop_ids, stop_disabled=p.stop_disabled, processed_logprobs=p.processed_logprobs,
        )


@dataclass
class GeneratedSequence:
    tokens: list[int]
    logprobs: list[float]       # log p(token): raw model (T=1, full vocab) unless processed_logprobs
    stop_reason: str            # "stop" | "length"
    topk_ids: list[list[int]] | None = None        # per position, the k most likely tokens (raw)
    topk_logprobs: list[list[float]] | None = None


@dataclass
class SampleResult:
    sequences: list[GeneratedSequence]
    prompt_logprobs: np.ndarray | None = None   # float32 (len(prompt),), NaN at position 0


@dataclass
class SampleRequest:
    adapter_id: str | None
    prompt: np.ndarray
    num_samples: int
    options: SamplingOptions
    prompt_logprobs: bool = False
    topk_logprobs: int = 0


@dataclass
class ModelDescription:
    base_model: str
    tokenizer_id: str
    vocab_size: int
    max_context_length: int
    loaded_adapters: list[str] = field(default_factory=list)


class SamplerBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def describe(self) -> ModelDescription: ...

    @abc.abstractmethod
    def load_adapter(self, adapter_id: str, folder: Path) -> None:
        """Load (or replace) a peft adapter folder under ``adapter_id``."""

    @abc.abstractmethod
    def drop_adapter(self, adapter_id: str) -> None: ...

    @abc.abstractmethod
    def sample(
        self, adapter_id: str | None, prompt: np.ndarray, num_samples: int, options: SamplingOptions, prompt_logprobs: bool
    ) -> SampleResult: ...

    def sample_batch(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Serve several requests (possibly for different adapters) together; backends that can
        decode them in one batch override this."""
        return [self.sample(r.adapter_id, r.prompt, r.num_samples, r.options, r.prompt_logprobs) for r in requests]

    @abc.abstractmethod
    def compute_logprobs(self, adapter_id: str | None, prompt: np.ndarray) -> np.ndarray:
        """float32 log p(prompt[i] | prompt[:i]) for each position, NaN at position 0."""
