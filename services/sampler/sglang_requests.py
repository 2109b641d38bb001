"""Temper sampling requests <-> SGLang generate arguments and outputs (pure Python: no sglang import).

Pinned version: sglang 0.5.23 (``pyproject.toml``, extra ``sglang``). Every shape here is read from its
source: ``srt/managers/io_struct.py::GenerateReqInput`` (per-item lists of input_ids, sampling_params,
return_logprob, logprob_start_len, top_logprobs_num, lora_path, return_sampling_mask,
sampling_logprobs_mode), ``srt/sampling/sampling_params.py::SamplingParams`` (max_new_tokens, stop,
stop_token_ids, temperature, top_p, top_k, ignore_eos, sampling_seed, n) and the output dict built in
``srt/managers/tokenizer_manager.py`` (``output_ids``; ``meta_info``: ``finish_reason``,
``input_token_logprobs`` / ``output_token_logprobs`` as ``(logprob, token_id, text)`` triples,
``input_top_logprobs`` / ``output_top_logprobs``, ``output_token_sampling_logprobs``).

Option mapping (each Temper option maps exactly, or the request is refused naming it):
- num_samples -> one SGLang item per sample, never SGLang's ``n``: with a seed, SGLang seeds every
  copy of an ``n`` request alike (``multinomial_with_seed(seed, positions)``), so n copies would be
  one sequence n times. Sample i gets ``sampling_seed = derive_seed(seed, i)``; without a seed a
  fresh random one, because deterministic mode seeds unseeded rows with 42
  (``srt/sampling/sampling_batch_info.py``).
- seed -> ``sampling_seed``. SGLang honours it only with ``enable_deterministic_inference``;
  a sampler started without it refuses seeded requests (``seed``).
- temperature (0 = greedy), top_k (0 = all -> -1), top_p, max_tokens -> the same-named SGLang fields.
  ``sampling_defaults="openai"`` at start, and every field sent, so a model's generation_config
  never fills one in.
- Stops. Temper: none given -> the model's end-of-sequence ids; stop ids and/or strings given ->
  exactly those; stop_disabled -> no token stops (strings still apply). SGLang's ``ignore_eos`` turns off *all* token stops
  (``Req._check_token_based_finish``) and without it EOS always stops. So: strings only ->
  ``ignore_eos`` + ``stop``; ids (with or without strings) -> ``stop_token_ids`` + ``stop``, which
  must include every EOS id (else refused: ``stop_token_ids``); disabled -> ``ignore_eos``.
  SGLang's ``output_ids`` keep the stop token (``finished_len`` = "stop included"), as Temper does.
- topk_logprobs, topk_prompt_logprobs -> one ``top_logprobs_num`` (SGLang has one for prompt and
  output): the larger, each side cut to its own k.
- prompt logprobs (and last_n) -> ``logprob_start_len`` on the first sample's item; SGLang answers
  ``None`` for the first scored position, which is Temper's NaN.

The logprob contract (``processed_logprobs``). Temper reports log p(token) under the raw model
(temperature 1, full vocabulary) unless ``processed_logprobs``. SGLang's default is neither: it
reports ``log_softmax(logits / temperature)`` (``srt/layers/sampler.py::Sampler.forward``), before
top-k/top-p. With ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``ENGINE_ENV``, set before the engine
starts: ``sampler.py`` reads it at import) it reports ``log_softmax(logits)``: raw, for sampled
tokens and the top-k alike; prompt logprobs are always raw. ``processed_logprobs`` then asks for the
sampling mask (``return_sampling_mask``, mode ``selected``): log(weight of the token / mass of the
support after temperature, top-k and top-p), the distribution the token was drawn from. SGLang
computes it only for a finite ``1 <= top_k <= sampling_mask_max_tokens``, so top_k 0 is sent as the
vocabulary size when that fits, else refused (``processed_logprobs``). Greedy rows are a point mass:
0.0, as the torch backend reports.

Images (vision-language models; ``sglang_images.py`` says what 0.5.23 serves and why): an item carries
its images as ``image_data`` (data URLs) and its ``input_ids`` with each image as ONE image token, which
SGLang expands into the image's N tokens itself (``BaseMultimodalProcessor.build_input_ids``); its
``prompt_tokens`` must then equal Temper's flattened length (else Internal: the two processors differ).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field

import numpy as np

from temper.common.errors import AdapterNotLoaded, Internal, InvalidArgument, ResourceExhausted, TemperError, Unavailable
from temper.common.validation import TOPK_MASK_LOGPROB
from temper.services.sampler.backend import (GeneratedSequence, Piece, SampleRequest, SampleResult, SamplingOptions,
                                             VersionSpan)

# Set in the sampler's environment before sglang is imported (its subprocesses inherit it).
ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


@dataclass(frozen=True)
class ModelFacts:
    """What the mapping needs to know of the served model and engine."""

    vocab_size: int
    eos_ids: frozenset[int]
    deterministic: bool
    mask_max_tokens: int


@dataclass
class Item:
    """One SGLang generate item (one sequence) and where its answer goes."""

    request: int                 # index into the batch's requests
    sample: int                  # index of the sequence within its request
    input_ids: list[int]
    sampling_params: dict
    lora_name: str | None
    logprob_start_len: int = -1  # -1: output tokens only
    top_logprobs_num: int = 0
    sampling_mask: bool = False
    image_data: list[str] = field(default_factory=list)   # data URLs; input_ids then hold one image token each
    flat_length: int = 0                                   # the prompt's length with its images expanded
    extra_key: str = ""                                    # the radix cache's namespace (cache_namespace)


@dataclass
class Batch:
    """Per-item lists: the shape of a batch ``GenerateReqInput``."""

    items: list[Item] = field(default_factory=list)

    def request_fields(self) -> dict:
        """``GenerateReqInput`` fields (io_struct.py) for the whole batch."""
        it = self.items
        fields = dict(
            input_ids=[i.input_ids for i in it], sampling_params=[i.sampling_params for i in it],
            return_logprob=[True] * len(it), logprob_start_len=[i.logprob_start_len for i in it],
            top_logprobs_num=[i.top_logprobs_num for i in it], lora_path=[i.lora_name for i in it],
            extra_key=[i.extra_key for i in it],
        )
        if any(i.image_data for i in it):  # a list per item ([] for text), as io_struct._normalize_image_data reads it
            fields["image_data"] = [list(i.image_data) for i in it]
        if any(i.sampling_mask for i in it):
            fields["return_sampling_mask"] = [i.sampling_mask for i in it]
            fields["sampling_logprobs_mode"] = ["selected" if i.sampling_mask else None for i in it]
        return fields


def derive_seed(seed: int, sample: int) -> int:
    """A stable 63-bit seed for sample ``sample`` of a request seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_options(options: SamplingOptions, facts: ModelFacts) -> None:
    """Refuse what SGLang cannot do exactly, naming the option (INVALID_ARGUMENT)."""
    if options.seed is not None and not facts.deterministic:
        raise InvalidArgument("seed: this sampler runs SGLang without deterministic inference, which ignores seeds "
                              "(TEMPER_SAMPLER_SGLANG_DETERMINISTIC=true honours them); send no seed")
    if options.stop_token_ids and not options.stop_disabled and not facts.eos_ids <= set(options.stop_token_ids):
        raise InvalidArgument(f"stop_token_ids: SGLang always stops at the model's end-of-sequence ids "
                              f"{sorted(facts.eos_ids)} when any stop id is set; include them, or stop on strings only")
    if options.processed_logprobs and options.temperature > 0:
        k = options.top_k or facts.vocab_size
        if k > facts.mask_max_tokens:
            raise InvalidArgument(f"processed_logprobs: with temperature > 0 SGLang reports the processed distribution "
                                  f"only for top_k in [1, {facts.mask_max_tokens}]; got top_k={options.top_k or 'all'} "
                                  f"(vocabulary {facts.vocab_size})")


def sampling_params(options: SamplingOptions, seed: int | None, facts: ModelFacts, max_new_tokens: int | None = None) -> dict:
    top_k = options.top_k or -1
    if options.processed_logprobs and options.temperature > 0 and top_k == -1:
        top_k = facts.vocab_size  # the same set as "all", finite so SGLang builds the sampling mask
    params = {
        "max_new_tokens": options.max_tokens if max_new_tokens is None else max_new_tokens,
        "temperature": options.temperature, "top_p": options.top_p, "top_k": top_k, "min_p": 0.0, "n": 1,
        "stop": list(options.stop_strings),  # stop_disabled turns off token stops only (as in the torch backend)
        "stop_token_ids": list(options.stop_token_ids) if not options.stop_disabled else [],
        "ignore_eos": options.stop_disabled or bool(options.stop_strings and not options.stop_token_ids),
        "skip_special_tokens": False, "no_stop_trim": True,
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def cache_namespace(request: SampleRequest, lora_name: str | None) -> str:
    """SGLang's radix cache matches prefixes within one ``extra_key`` (``RadixKey(token_ids, extra_key)``
    in ``srt/managers/schedule_batch.py``): the tenant's sampling client and the adapter version, as the
    torch backend's prefix cache is scoped, so no prefix is reused across tenants, clients or versions.
    A request naming no client gets a namespace of its own (its samples still share its prompt)."""
    scope = f"{request.tenant}/{request.cache_session}" if request.cache_session else f"request/{secrets.token_hex(8)}"
    return f"{scope}/{lora_name or ''}"


def build_batch(requests: list[SampleRequest], lora_names: list[str | None], facts: ModelFacts) -> Batch:
    batch = Batch()
    for r_index, (request, lora_name) in enumerate(zip(requests, lora_names)):
        namespace = cache_namespace(request, lora_name)
        check_options(request.options, facts)
        top = max(request.topk_logprobs, request.topk_prompt_logprobs)
        for sample in range(request.num_samples):
            seed = (derive_seed(request.options.seed, sample) if request.options.seed is not None
                    else secrets.randbits(63) if facts.deterministic else None)
            scores_prompt = sample == 0 and (request.prompt_logprobs or request.topk_prompt_logprobs > 0)
            batch.items.append(Item(
                r_index, sample, collapsed_ids(request.prompt, request.images), sampling_params(request.options, seed, facts),
                lora_name, prompt_start(len(request.prompt), request.prompt_logprobs_last_n) if scores_prompt else -1,
                top, request.options.processed_logprobs and request.options.temperature > 0,
                image_urls(request.images), len(request.prompt), namespace,
            ))
    return batch


def scoring_item(prompt: np.ndarray, lora_name: str | None, last_n: int | None, images=()) -> Item:
    """A prefill-only item (max_new_tokens 0) that scores the prompt."""
    params = sampling_params(SamplingOptions(stop_disabled=True), None, ModelFacts(0, frozenset(), False, 0), 0)
    return Item(0, 0, collapsed_ids(prompt, images), params, lora_name, prompt_start(len(prompt), last_n),
                image_data=image_urls(images), flat_length=len(prompt))


def collapsed_ids(prompt: np.ndarray, images) -> list[int]:
    """``prompt`` with each image's N image tokens as one: SGLang expands an image token followed by
    anything else into the image's N (``build_input_ids``: one image per position whose next token is
    the image token), so N tokens sent as they are would read as N images."""
    ids = [int(t) for t in prompt]
    for image in sorted(images, key=lambda i: i.offset, reverse=True):
        del ids[image.offset + 1:image.offset + image.tokens]
    return ids


def image_urls(images) -> list[str]:
    import base64

    return [f"data:image/{i.format};base64,{base64.b64encode(i.data).decode()}" for i in images]


def check_prompt_length(item: Item, meta: dict) -> None:
    """SGLang's expansion of an item's images must be Temper's: else its positions are not Temper's."""
    if item.image_data and int(meta.get("prompt_tokens", item.flat_length)) != item.flat_length:
        raise Internal(f"sglang expanded the images into a {meta.get('prompt_tokens')}-token prompt; the model's image "
                       f"processor makes {item.flat_length} tokens (SGLang's processor differs from the model's)")


def prompt_start(n: int, last_n: int | None) -> int:
    """logprob_start_len scoring positions [n - last_n, n) (all but 0 by default): SGLang leaves the
    first position it covers unscored, so start one earlier."""
    return 0 if last_n is None else max(n - last_n - 1, 0)


# ---- outputs --------------------------------------------------------------------------------

def check_output(out: dict) -> None:
    """An aborted item raises the Temper error its SGLang status names."""
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise abort_error(reason.get("message") or "aborted", reason.get("status_code"))


def abort_error(message: str, status: int | None) -> TemperError:
    """SGLang aborts carry an HTTP status (``FINISH_ABORT``)."""
    status = int(status) if status is not None else 500
    if status == 400:
        return InvalidArgument(f"sglang: {message}")
    if status == 429:
        return ResourceExhausted(f"sglang: {message}")
    if status == 503:
        return Unavailable(f"sglang: {message}")
    return Internal(f"sglang aborted the request ({status}): {message}")


def generate_error(exc: Exception, lora_names: set[str]) -> TemperError:
    """``Engine.generate`` raises ValueError for a request it refuses (``TokenizerManager``: context
    length, sampling params, unknown adapters); anything else is the engine failing."""
    if isinstance(exc, TemperError):
        return exc
    text = str(exc)
    if isinstance(exc, ValueError):
        if "LoRA adapters are not loaded" in text or "never been loaded" in text:
            missing = next((n for n in lora_names if n in text), "?")
            return AdapterNotLoaded(missing.split("@", 1)[0])
        return InvalidArgument(f"sglang: {text}")
    return Internal(f"sglang engine failed: {type(exc).__name__}: {text}")


def parse_results(requests: list[SampleRequest], batch: Batch, outputs: list[dict]) -> list[SampleResult]:
    results = [SampleResult([None] * r.num_samples) for r in requests]  # type: ignore[list-item]
    for item, out in zip(batch.items, outputs):
        check_output(out)
        request, meta = requests[item.request], out["meta_info"]
        check_prompt_length(item, meta)
        results[item.request].sequences[item.sample] = _sequence(request, item, out, meta)
        if item.sample == 0:  # SGLang's radix-cache hit for the request's prompt (its first sequence's)
            results[item.request].prompt_cache_hit_tokens = int(meta.get("cached_tokens") or 0)
        if item.logprob_start_len >= 0:
            _fill_prompt(results[item.request], request, item, meta)
    return results


def _sequence(request: SampleRequest, item: Item, out: dict, meta: dict) -> GeneratedSequence:
    tokens = [int(t) for t in out["output_ids"]]
    triples = meta["output_token_logprobs"][:len(tokens)]
    if [int(t) for _, t, _ in triples] != tokens:
        raise Internal("sglang: output_token_logprobs do not match output_ids")
    if not item.sampling_mask:
        logprobs = [0.0] * len(tokens) if request.options.processed_logprobs else [float(lp) for lp, _, _ in triples]
    else:
        logprobs = [float(x) for x in meta["output_token_sampling_logprobs"][:len(tokens)]]
    topk_ids = topk_lps = None
    if request.topk_logprobs:
        k = request.topk_logprobs
        rows = meta["output_top_logprobs"][:len(tokens)]
        topk_ids = [[int(t) for _, t, _ in row[:k]] for row in rows]
        topk_lps = [[float(lp) for lp, _, _ in row[:k]] for row in rows]
    reason = (meta.get("finish_reason") or {}).get("type")
    # SGLang cannot move a running request to another adapter: every token is on the version it started on
    return GeneratedSequence(tokens, logprobs, "stop" if reason == "stop" else "length", topk_ids, topk_lps,
                             [VersionSpan(request.weights, 0, len(tokens))] if tokens else [])


def prompt_logprobs(n: int, item: Item, meta: dict) -> np.ndarray:
    """float32 (n,), NaN where unscored, from ``input_token_logprobs`` (position logprob_start_len on)."""
    out = np.full(n, np.nan, dtype=np.float32)
    for offset, (lp, _, _) in enumerate(meta["input_token_logprobs"]):
        if lp is not None:
            out[item.logprob_start_len + offset] = lp
    return out


def _fill_prompt(result: SampleResult, request: SampleRequest, item: Item, meta: dict) -> None:
    n = len(request.prompt)
    if request.prompt_logprobs:
        result.prompt_logprobs = prompt_logprobs(n, item, meta)
    k = request.topk_prompt_logprobs
    if k:
        ids = np.zeros((n, k), dtype=np.int32)
        lps = np.full((n, k), TOPK_MASK_LOGPROB, dtype=np.float32)
        for offset, row in enumerate(meta["input_top_logprobs"]):
            if row:
                pos = item.logprob_start_len + offset
                ids[pos, :len(row[:k])] = [int(t) for _, t, _ in row[:k]]
                lps[pos, :len(row[:k])] = [float(lp) for lp, _, _ in row[:k]]
        result.topk_prompt_ids, result.topk_prompt_logprobs = ids, lps


class StreamedBatch:
    """The outputs of a streaming ``generate`` of a batch, as they come: each is one item's output so far,
    named by its ``index`` in the batch. SGLang's default (not ``incremental_streaming_output``) sends an
    item's whole output each time; anything else is refused (Internal) rather than misread. The new
    tokens of an item go to its request's ``progress``; the last output of each item is the answer."""

    def __init__(self, requests: list[SampleRequest], batch: Batch):
        self.requests, self.batch = requests, batch
        self._last: list[dict | None] = [None] * len(batch.items)
        self._sent = [0] * len(batch.items)

    def take(self, out: dict | list) -> None:
        for one in out if isinstance(out, list) else [out]:
            index = one.get("index", 0 if len(self.batch.items) == 1 else None)
            if not isinstance(index, int) or not 0 <= index < len(self.batch.items):
                raise Internal(f"sglang: a streamed output names no item of the batch (index {index!r})")
            self._take(index, one)

    def _take(self, index: int, out: dict) -> None:
        check_output(out)
        item, before = self.batch.items[index], self._last[index]
        request = self.requests[item.request]
        tokens = [int(t) for t in out["output_ids"]]
        had = [int(t) for t in before["output_ids"]] if before is not None else []
        if had != tokens[:len(had)]:
            raise Internal("sglang: a streamed output does not extend the one before (incremental streaming output?)")
        self._last[index] = out
        if request.progress is None:
            return
        finished = (out.get("meta_info") or {}).get("finish_reason") is not None
        if len(tokens) == self._sent[index] and not finished:
            return
        whole = _sequence(request, item, out, out["meta_info"])
        start, self._sent[index] = self._sent[index], len(tokens)
        topk = whole.topk_ids is not None
        request.progress([Piece(item.sample, whole.tokens[start:], whole.logprobs[start:],
                                whole.stop_reason if finished else None,
                                whole.topk_ids[start:] if topk else None, whole.topk_logprobs[start:] if topk else None,
                                [VersionSpan(request.weights, start, len(tokens) - start)] if len(tokens) > start else [])])

    def outputs(self) -> list[dict]:
        if any(o is None for o in self._last):
            raise Internal("sglang: a streamed batch ended with an item that never answered")
        return self._last  # type: ignore[return-value]
