"""The sampler backend interface. The torch backend implements it for CPU/GPU development; the
SGLang backend (``sglang_backend.py``, CUDA, an in-process ``sglang.Engine`` with LoRA) for GPU serving.

Transport-free (``convert.py`` maps protobuf onto these types). A sampler serves the base model
plus the LoRA weights of saved checkpoints, each loaded under its checkpoint key
("<run>/sampler_weights/<name>"); a key of None means the base model.

Streaming: a request with ``progress`` set is told what each of its sequences gained, as ``Piece``s,
after every decode step (``sample_batch`` calls it on the compute thread). A backend that cannot
stream calls it once, at the end, with every sequence whole: the pieces of a sequence, joined, are
always its ``GeneratedSequence``.

Versions (docs/async_rl.md): every sequence and piece carries ``VersionSpan``s saying which weights
decoded its tokens. A request names the ``WeightsVersion`` its checkpoint key holds; one that follows a
training run's in-flight target (``retarget`` set) may move to newer weights between decode steps, so its
sequences then have several spans. A backend that leaves ``versions`` empty decoded every token on the
request's own version (the servicer fills in that one span)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from temper.services.models.images import ImageInput, VisionProcessor


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


@dataclass(frozen=True)
class WeightsVersion:
    """The weights a checkpoint key holds: its sampler checkpoint path ("" for the base model) and its
    training run's in-flight version (0 for a snapshot checkpoint or the base model)."""

    path: str = ""
    version: int = 0


@dataclass
class VersionSpan:
    """Tokens [first, first + count) of a sequence were decoded with ``weights``."""

    weights: WeightsVersion
    first: int
    count: int


def add_token(spans: list[VersionSpan], weights: WeightsVersion, position: int) -> None:
    """Record that the token at ``position`` (the next one) was decoded with ``weights``."""
    if spans and spans[-1].weights == weights:
        spans[-1].count += 1
    else:
        spans.append(VersionSpan(weights, position, 1))


# The servicer's follow hook of an in-flight request: given the version a request decodes with now,
# the (checkpoint key, version) to move to from the next step on, or None to stay.
Retarget = Callable[[WeightsVersion], tuple[str, WeightsVersion] | None]
# Run between two decode steps (adapter installs): told the checkpoint keys the running batch uses.
BetweenSteps = Callable[[frozenset], None]


@dataclass
class GeneratedSequence:
    tokens: list[int]
    logprobs: list[float]       # log p(token): raw model (T=1, full vocab) unless processed_logprobs
    stop_reason: str            # "stop" | "length"
    topk_ids: list[list[int]] | None = None        # per position, the k most likely tokens (raw)
    topk_logprobs: list[list[float]] | None = None
    versions: list[VersionSpan] = field(default_factory=list)   # empty: all on the request's ``weights``


@dataclass
class Piece:
    """The tokens one sequence of a request gained since its last piece (streaming)."""

    sequence: int               # index within the request's num_samples
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str | None = None   # "stop" | "length" on the sequence's last piece
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    # its tokens' weights, ``first`` counted from the sequence's start; empty: the request's ``weights``
    versions: list[VersionSpan] = field(default_factory=list)


Progress = Callable[[list[Piece]], None]


@dataclass
class SampleResult:
    sequences: list[GeneratedSequence]
    prompt_logprobs: np.ndarray | None = None   # float32 (len(prompt),), NaN where not scored (position 0)
    topk_prompt_ids: np.ndarray | None = None       # int32 (len(prompt), k); unscored rows: id 0 ...
    topk_prompt_logprobs: np.ndarray | None = None  # float32 (len(prompt), k); ... and validation.TOPK_MASK_LOGPROB
    prompt_cache_hit_tokens: int = 0   # leading prompt tokens whose KV was reused from earlier requests


@dataclass
class SampleRequest:
    checkpoint_key: str | None
    prompt: np.ndarray
    num_samples: int
    options: SamplingOptions
    prompt_logprobs: bool = False
    topk_logprobs: int = 0
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None   # score only the last n prompt positions
    progress: Progress | None = None            # streaming: told each decode step's pieces (module docstring)
    deterministic: bool = False                 # batch-invariant decode (docs/deterministic.md; torch backend)
    # the prompt's images (vision-language models): ``prompt`` holds each as its N image tokens from ``offset``
    images: tuple[ImageInput, ...] = ()
    # the prefix cache's scope (prefix_cache.py): the sampling client it came from and its tenant; "": not cached
    cache_session: str = ""
    tenant: str = ""
    weights: WeightsVersion = WeightsVersion()   # what checkpoint_key holds (its tokens' version spans)
    # an in-flight request that follows its run's target between decode steps (torch backend; None: it does not)
    retarget: Retarget | None = None
    between_steps: BetweenSteps | None = None   # the servicer's pending adapter installs (decode_steps calls it)


@dataclass
class ModelDescription:
    base_model: str
    tokenizer_id: str
    vocab_size: int
    max_context_length: int
    loaded_checkpoints: list[str] = field(default_factory=list)   # checkpoint keys
    # why this backend cannot serve deterministic requests (docs/deterministic.md); "": it can
    deterministic_unsupported: str = "this sampler backend has no deterministic mode"
    vision: VisionProcessor | None = None   # a vision-language model's image token ids and processor


class SamplerBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def describe(self) -> ModelDescription: ...

    @abc.abstractmethod
    def check_adapter(self, folder: Path) -> None:
        """InvalidArgument if ``load_adapter`` would refuse this adapter folder; touches nothing (the
        servicer asks before it evicts anything to make room)."""

    @abc.abstractmethod
    def load_adapter(self, checkpoint_key: str, folder: Path) -> None:
        """Load (or replace) the peft adapter folder of a checkpoint under ``checkpoint_key``."""

    @abc.abstractmethod
    def drop_adapter(self, checkpoint_key: str) -> None:
        """AdapterNotLoaded if it is not loaded (so do ``sample`` and ``compute_logprobs``)."""

    @abc.abstractmethod
    def sample(
        self, checkpoint_key: str | None, prompt: np.ndarray, num_samples: int, options: SamplingOptions, prompt_logprobs: bool
    ) -> SampleResult: ...

    def sample_batch(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Serve several requests (possibly for different adapters) together; backends that can
        decode them in one batch override this."""
        results = []
        for r in requests:
            results.append(self.sample(r.checkpoint_key, r.prompt, r.num_samples, r.options, r.prompt_logprobs))
            if r.progress is not None:
                r.progress(whole_pieces(results[-1]))
        return results

    @abc.abstractmethod
    def compute_logprobs(self, checkpoint_key: str | None, prompt: np.ndarray, last_n: int | None = None,
                         deterministic: bool = False, images: tuple[ImageInput, ...] = ()) -> np.ndarray:
        """float32 log p(prompt[i] | prompt[:i]) for each position, NaN at position 0 (and before the
        last ``last_n`` positions when given). ``deterministic``: the prompt scored alone with the
        batch-invariant primitives, as the trainer's forward scores it (FailedPrecondition where the
        backend cannot: ``describe().deterministic_unsupported``). ``images``: the prompt's images, each
        as its N image tokens in ``prompt`` (one position per token, as for text)."""


def whole_pieces(result: SampleResult) -> list[Piece]:
    """Every sequence of a result as one last piece (a backend that does not stream)."""
    return [Piece(i, s.tokens, s.logprobs, s.stop_reason, s.topk_ids, s.topk_logprobs, list(s.versions))
            for i, s in enumerate(result.sequences)]


def fill_versions(result: SampleResult, weights: WeightsVersion) -> SampleResult:
    """Sequences a backend left without spans were decoded wholly on ``weights``: one span each (none
    for a sequence without tokens: spans cover tokens)."""
    for seq in result.sequences:
        if not seq.versions and seq.tokens:
            seq.versions = [VersionSpan(weights, 0, len(seq.tokens))]
    return result
