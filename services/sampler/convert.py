"""The sampler's one protobuf <-> domain boundary (temper.v1 messages <-> backend objects).

Requests are checked here as they are decoded (sampling parameters, counts, stop tokens); the
backend checks what depends on its state (loaded checkpoints, prompt tokens, context length).
"""

from __future__ import annotations

import numpy as np

from temper.common.codec import decode_tokens, encode_array, encode_floats, encode_tokens
from temper.common.errors import InvalidArgument
from temper.common.validation import (  # noqa: F401 (MAX_TOPK_LOGPROBS, MIN_TEMPERATURE: re-exported)
    MAX_TOPK_LOGPROBS, MIN_TEMPERATURE, check_last_n, check_prompt_scoring, check_sample_counts, check_sampling_params)
from temper.services.sampler.backend import (ModelDescription, Piece, SampleRequest, SampleResult, SamplingOptions,
                                             VersionSpan, WeightsVersion)
from temper.services.sampler.inflight import check_target
from temper.common.defaults import sampling_with_defaults
from temper.services.models.images import DEFAULT_LIMITS, ImageInput, ImageLimits, VisionProcessor, flatten
from temper.v1 import sampler_pb2, types_pb2

_STOP_REASONS = {"stop": types_pb2.STOP_REASON_STOP, "length": types_pb2.STOP_REASON_LENGTH}


def sampling_options_from_pb(p: types_pb2.SamplingParams, vocab_size: int) -> SamplingOptions:
    # the scheduler checked the same rules before calling (validation.py); checked again here
    p = sampling_with_defaults(p)  # a raw client's unset fields: Tinker's defaults
    stop_ids = check_sampling_params(p, vocab_size)
    return SamplingOptions(
        max_tokens=p.max_tokens, seed=p.seed if p.HasField("seed") else None, temperature=p.temperature,
        top_k=max(p.top_k, 0), top_p=p.top_p if 0 < p.top_p < 1 else 1.0, stop_strings=tuple(p.stop_strings),
        stop_token_ids=stop_ids, stop_disabled=p.stop_disabled, processed_logprobs=p.processed_logprobs,
    )


def prompt_from_pb(request, vision: VisionProcessor | None, limits: ImageLimits = DEFAULT_LIMITS,
                   model: str = "the base model") -> tuple[np.ndarray, tuple[ImageInput, ...]]:
    """(prompt tokens, their images). With ``request.prompt`` set (a prompt with images), it is
    flattened by the one image path (images checked, each expanded into its N image tokens) and must
    equal ``prompt_tokens``, which the scheduler flattened the same way. Pointers never reach a
    sampler (the scheduler resolves them to bytes), so none is resolved here."""
    tokens = decode_tokens(request.prompt_tokens)
    if not request.HasField("prompt"):
        return tokens, ()
    flat = flatten(request.prompt, vision, limits, "prompt", resolve_pointer=None, model=model)
    if not np.array_equal(flat.tokens, tokens):
        raise InvalidArgument(f"prompt_tokens ({len(tokens)} tokens) are not the prompt flattened ({len(flat)} tokens, "
                              f"each image as its image tokens)")
    return tokens, flat.images


def sample_request_from_pb(request: sampler_pb2.SamplerSampleRequest, vocab_size: int, max_num_samples: int,
                           vision: VisionProcessor | None = None, limits: ImageLimits = DEFAULT_LIMITS,
                           model: str = "the base model") -> SampleRequest:
    check_sample_counts(request.num_samples, request.topk_logprobs, request.topk_prompt_logprobs, vocab_size, max_num_samples)
    options = sampling_options_from_pb(request.sampling_params, vocab_size)
    prompt, images = prompt_from_pb(request, vision, limits, model)
    last_n = request.prompt_logprobs_last_n if request.HasField("prompt_logprobs_last_n") else None
    check_prompt_scoring(len(prompt), request.include_prompt_logprobs, request.topk_prompt_logprobs, last_n)
    if bool(request.sampling_session_id) != bool(request.tenant):  # a session without its tenant could be shared
        raise InvalidArgument("sampling_session_id and tenant are set together (the prefix cache's scope) or not at all")
    weights = WeightsVersion(request.weights.path, request.weights.version)
    if request.inflight_run:  # a request that follows a run's in-flight target starts on one of its versions
        check_target(request.inflight_run, request.checkpoint_key, weights)
    elif weights.version < 0:
        raise InvalidArgument(f"weights.version must be >= 0, got {weights.version}")
    return SampleRequest(request.checkpoint_key or None, prompt, request.num_samples, options,
                         request.include_prompt_logprobs, request.topk_logprobs, request.topk_prompt_logprobs, last_n,
                         deterministic=request.deterministic, images=images,
                         cache_session=request.sampling_session_id, tenant=request.tenant, weights=weights)


def sample_result_to_pb(result: SampleResult, topk_logprobs: int) -> types_pb2.SampleResponse:
    response = types_pb2.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
    for seq in result.sequences:
        out = response.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason], tokens=encode_tokens(seq.tokens), logprobs=encode_floats(seq.logprobs)
        )
        if seq.topk_ids is not None:
            out.topk = topk_logprobs
            out.topk_token_ids = encode_tokens([t for row in seq.topk_ids for t in row])
            out.topk_logprobs = encode_floats([x for row in seq.topk_logprobs for x in row])
        _add_spans(out.versions, seq.versions)
    if result.prompt_logprobs is not None:
        response.prompt_logprobs.CopyFrom(encode_array(result.prompt_logprobs, "float32"))
    if result.topk_prompt_ids is not None:
        response.topk_prompt_token_ids.CopyFrom(encode_array(result.topk_prompt_ids, "int32"))
        response.topk_prompt_logprobs.CopyFrom(encode_array(result.topk_prompt_logprobs, "float32"))
    return response


def pieces_to_pb(pieces: list[Piece], topk_logprobs: int) -> types_pb2.SampleStreamChunk:
    chunk = types_pb2.SampleStreamChunk()
    for p in pieces:
        out = chunk.pieces.add(index=p.sequence, tokens=encode_tokens(p.tokens), logprobs=encode_floats(p.logprobs),
                               stop_reason=_STOP_REASONS[p.stop_reason] if p.stop_reason else types_pb2.STOP_REASON_UNSPECIFIED)
        if p.topk_ids is not None:
            out.topk = topk_logprobs
            out.topk_token_ids = encode_tokens([t for row in p.topk_ids for t in row])
            out.topk_logprobs = encode_floats([x for row in p.topk_logprobs for x in row])
        _add_spans(out.versions, p.versions)
    return chunk


def _add_spans(field, spans: list[VersionSpan]) -> None:
    for span in spans:
        field.add(weights=types_pb2.WeightsVersion(path=span.weights.path, version=span.weights.version),
                  first_token=span.first, count=span.count)


def spans_from_pb(versions) -> list[VersionSpan]:
    """A sequence's or piece's ``versions`` (types.proto VersionSpan) as backend spans."""
    return [VersionSpan(WeightsVersion(v.weights.path, v.weights.version), v.first_token, v.count) for v in versions]


def stream_end_to_pb(result: SampleResult) -> types_pb2.SampleStreamChunk:
    """The done message of a stream: the prompt's scores, as Sample answers them (the tokens went before)."""
    whole = sample_result_to_pb(SampleResult([], result.prompt_logprobs, result.topk_prompt_ids,
                                             result.topk_prompt_logprobs), 0)
    chunk = types_pb2.SampleStreamChunk(done=True)
    for name in ("prompt_logprobs", "topk_prompt_token_ids", "topk_prompt_logprobs"):
        if whole.HasField(name):
            getattr(chunk, name).CopyFrom(getattr(whole, name))
    return chunk


def logprobs_request_from_pb(request: sampler_pb2.SamplerLogprobsRequest, vision: VisionProcessor | None = None,
                             limits: ImageLimits = DEFAULT_LIMITS, model: str = "the base model",
                             ) -> tuple[str | None, np.ndarray, int | None, bool, tuple[ImageInput, ...]]:
    """(checkpoint key or None for the base model, prompt tokens, last n positions to score or None,
    deterministic, the prompt's images)."""
    prompt, images = prompt_from_pb(request, vision, limits, model)
    last_n = request.prompt_logprobs_last_n if request.HasField("prompt_logprobs_last_n") else None
    if last_n is not None:
        check_last_n(len(prompt), last_n)
    return request.checkpoint_key or None, prompt, last_n, request.deterministic, images


def logprobs_to_pb(logprobs: np.ndarray) -> sampler_pb2.ComputeLogprobsResponseInternal:
    return sampler_pb2.ComputeLogprobsResponseInternal(logprobs=encode_array(logprobs, "float32"))


def model_info_to_pb(description: ModelDescription, backend: str, incarnation: str = "") -> sampler_pb2.SamplerModelInfo:
    d = description
    return sampler_pb2.SamplerModelInfo(
        base_model=d.base_model, tokenizer_id=d.tokenizer_id, vocab_size=d.vocab_size, max_context_length=d.max_context_length,
        backend=backend, loaded_adapters=d.loaded_checkpoints, incarnation=incarnation,
        deterministic_unsupported=d.deterministic_unsupported, vision=d.vision.info() if d.vision else None,
    )
