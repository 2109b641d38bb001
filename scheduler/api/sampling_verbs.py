"""The sampling verbs of the public API: sampling clients, Sample, ComputeLogprobs.

A sampling client belongs to its session's tenant; it samples the base model, one of the tenant's
checkpoints, or a checkpoint another tenant published. Sampling over the tenant's tokens per minute
waits (quotas.py); a closed session's sampling clients answer FAILED_PRECONDITION; once its
checkpoint is unpublished, deleted or expired, a sampling client answers NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass

import numpy as np

from temper.common.checkpoints import parse_path
from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound
from temper.common.defaults import sampling_with_defaults
from temper.common.validation import check_last_n, check_prompt_scoring, check_sample_counts, check_sampling_params, check_token_range
from temper.scheduler import metrics
from temper.scheduler.tenancy.auth import caller
from temper.scheduler.api.inflight_verbs import InflightSampling, PieceSpans, fill_spans
from temper.scheduler.api.image_inputs import CheckedPrompt, check_prompt, has_images, pointer_digests, serves_images, vision_of
from temper.scheduler.api.lookup_verbs import check_deterministic
from temper.scheduler.db import models as m
from temper.scheduler.db.records import SamplingRow
from temper.scheduler.planning.records import SamplingRecorder, unix_ms
from temper.scheduler.workers.sampler_streams import stream_on_a_sampler
from temper.scheduler.workers.samplers import SamplerHandle
from temper.services.models.images import DEFAULT_LIMITS, ImageLimits
from temper.v1 import sampler_pb2, service_pb2, types_pb2

REQUEST_TAG = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TOUCH_SECONDS = 60.0  # a checkpoint's last use by a sampling client is written at most this often


@dataclass
class SamplingTarget:
    base_model: str         # any of its samplers may serve the request (backends.call_samplers)
    info: sampler_pb2.SamplerModelInfo
    checkpoint_key: str     # "" for the base model
    tokens: np.ndarray      # the prompt as the model sees it: each image as its N image tokens
    tenant: str
    model_path: str | None = None  # the checkpoint's path; its last use is written once the request is accepted
    session_id: str = ""           # the sampling client's session (its sampling records)
    deterministic: bool = False    # the client samples deterministically (docs/deterministic.md)
    prompt: types_pb2.ModelInput | None = None  # with images: for the sampler, pointers resolved (image_inputs.py)
    weights: types_pb2.WeightsVersion | None = None  # what checkpoint_key holds (docs/async_rl.md)
    inflight_run: str = ""                           # an in-flight client's run: the sampler may move it to a newer version

    def to_sampler(self, request) -> None:
        """The prompt into a sampler's request: its tokens, and the prompt itself when it has images."""
        request.prompt_tokens = self.tokens.astype("<i4").tobytes()
        if self.prompt is not None:
            request.prompt.CopyFrom(self.prompt)


class SamplingVerbs(InflightSampling):
    """Mixed into TemperServicer (store, backends, runs, admission come from it)."""

    def _init_sampling(self, image_limits: ImageLimits = DEFAULT_LIMITS) -> None:
        self._image_limits = image_limits  # the scheduler's (settings): also the uploads' (image_verbs.py)
        self._samplers: dict[str, tuple[m.SamplingClient, str]] = {}  # sampler id -> (row, tenant)
        self._touched: dict[str, float] = {}
        self._sampling_records = SamplingRecorder(self.store)  # each answer's record, group-committed

    async def CreateSamplingClient(self, request, context):
        await self.backends.wait_ready()
        tenant = caller()
        await asyncio.to_thread(self.store.open_session, request.session_id, tenant)
        source = request.WhichOneof("source")
        if source == "model_path":
            path = parse_path(request.model_path)
            checkpoint = await asyncio.to_thread(self.store.readable_checkpoint, str(path), tenant)
            run = await self.runs.get(checkpoint.training_run_id)  # may be another tenant's: the checkpoint is published
            base_model, model_path = run.base_model, str(path)
            # a deterministic run's checkpoints sample as the trainer computes, whatever the request says
            deterministic = bool(run.row.deterministic) or request.deterministic
            await self.backends.served("sampler", base_model)  # its samplers may be registering again: waited for
            info = self.backends.sampler_info(base_model)
            if deterministic:  # refused before the adapter is pushed: nothing is evicted for it
                check_deterministic(info, base_model)
            # pushed now, to the sampler its first request will likely go to (another one if that one is down)
            await self.backends.on_a_sampler(base_model, path.key, None, load=lambda s: self._ensure_loaded(s, path.key, tenant))
            await asyncio.to_thread(self.store.touch_checkpoint, model_path)
        elif source == "inflight_training_run_id":  # follows the run's target (inflight_verbs.py)
            base_model, info, deterministic, target = await self._inflight_source(request, tenant)
            row = await asyncio.to_thread(self.store.add_sampling_client, request.session_id, base_model, None, deterministic,
                                          target.run_id, target.version)
            self._samplers[row.id] = (row, tenant)
            return service_pb2.SamplingClientInfo(
                sampler_id=row.id, base_model=base_model, model_path=target.path, tokenizer_id=info.tokenizer_id,
                vocab_size=info.vocab_size, deterministic=deterministic, inflight_training_run_id=target.run_id,
                min_version=target.version)
        elif source == "base_model":
            base_model, model_path = request.base_model, None
            await self.backends.served("sampler", base_model)  # NotFound only for a model unknown here
            info = self.backends.sampler_info(base_model)
            deterministic = self._deterministic(request)
            if deterministic:
                check_deterministic(info, base_model)
        else:
            raise InvalidArgument("give base_model, model_path or inflight_training_run_id")
        row = await asyncio.to_thread(self.store.add_sampling_client, request.session_id, base_model, model_path, deterministic)
        self._samplers[row.id] = (row, tenant)
        return service_pb2.SamplingClientInfo(
            sampler_id=row.id, base_model=base_model, model_path=model_path or "", tokenizer_id=info.tokenizer_id,
            vocab_size=info.vocab_size, deterministic=deterministic,
        )

    async def _ensure_loaded(self, sampler: SamplerHandle, key: str, tenant: str) -> None:
        """The checkpoint's adapter on ``sampler``, within the tenant's resident-adapter limit (the caller
        checked that the tenant may read it)."""
        run = await self.runs.get(parse_path(f"tinker://{key}").training_run_id)
        limit = (await self.admission.quotas.limits(tenant)).max_resident_adapters
        await self.backends.push_checkpoint(self.backends.trainer_for(run.base_model, run.run_id), sampler, key,
                                            tenant=tenant, max_resident=limit)

    async def _sampling_target(self, sampler_id: str, prompt: types_pb2.ModelInput) -> SamplingTarget:
        tenant = caller()
        cached = self._samplers.get(sampler_id)
        if cached is None:
            row, owner, closed = await asyncio.to_thread(self.store.get_sampling_client, sampler_id, tenant)
            if closed:
                self._closed_sessions.add(row.session_id)
            cached = self._samplers[sampler_id] = (row, owner)
        row, owner = cached
        if owner != tenant:
            raise NotFound(f"sampling client {sampler_id!r} not found")
        if row.session_id in self._closed_sessions:
            raise FailedPrecondition(f"the session of sampling client {sampler_id} is closed")
        await self.backends.served("sampler", row.base_model)  # after a restart, until its samplers register again
        info = self.backends.sampler_info(row.base_model)
        checkpoint_key, model_path, inflight_run = "", row.model_path, row.inflight_run_id or ""
        weights = types_pb2.WeightsVersion(path=model_path or "", version=0)
        if inflight_run:  # the run's target now: a newer one than the last request's, if a save moved it
            target = await self._target_of(row)
            model_path, weights = target.path, target.weights()
        if model_path:
            path = parse_path(model_path)
            checkpoint_key = path.key
            await self._still_readable(str(path), tenant)
        tokens, with_images = await self._checked_prompt(prompt, info, tenant, row.base_model)
        if tokens.size == 0:
            raise InvalidArgument("prompt is empty")
        check_token_range(tokens, info.vocab_size, "prompt")
        if len(tokens) > info.max_context_length:
            raise InvalidArgument(f"prompt has {len(tokens)} tokens; the context length is {info.max_context_length}")
        if row.deterministic:  # its sampler may have been replaced by one that cannot (refused, nothing sampled)
            check_deterministic(info, row.base_model)
        return SamplingTarget(row.base_model, info, checkpoint_key, tokens, tenant, model_path or None, row.session_id,
                              bool(row.deterministic), with_images, weights, inflight_run)

    async def _checked_prompt(self, prompt: types_pb2.ModelInput, info, tenant: str, base_model: str):
        """(tokens, the sampler's prompt with images or None), every chunk checked (image_inputs.py).
        Image pointers resolve to the tenant's own uploads only; images are decoded in a thread."""
        limits = self._image_limits
        if not has_images(prompt) and not serves_images(info):  # a text model's text prompt: no thread hop
            checked = check_prompt(prompt, None, limits, {}, base_model)
            return checked.tokens, checked.prompt
        digests = pointer_digests(prompt) if serves_images(info) else []  # a text model refuses them unread
        uploads = await asyncio.to_thread(self.store.image_data, tenant, digests) if digests else {}
        checked: CheckedPrompt = await asyncio.to_thread(
            lambda: check_prompt(prompt, vision_of(info), limits, uploads, base_model))
        return checked.tokens, checked.prompt

    async def _still_readable(self, path: str, tenant: str) -> None:
        """On every call, adapter held by a sampler or not: the checkpoint is still there, unexpired and
        the caller's to read. An unpublish, delete or expiry ends every sampling client on it, another
        tenant's and the owner's alike (NotFound). Known facts are kept exact without a query (db/access.py)."""
        allowed = self.store.read_access.may_read(path, tenant)
        if allowed is None:
            await asyncio.to_thread(self.store.readable_checkpoint, path, tenant)
        elif not allowed:
            raise NotFound(f"checkpoint {path} not found")

    async def _touch(self, target: SamplingTarget) -> None:
        """The checkpoint's last use, written (at most every TOUCH_SECONDS) for a request accepted: a
        refused one changes nothing."""
        path = target.model_path
        if path and time.monotonic() - self._touched.get(path, 0.0) > TOUCH_SECONDS:
            self._touched[path] = time.monotonic()
            await asyncio.to_thread(self.store.touch_checkpoint, path)

    async def _call_sampler(self, target: SamplingTarget, method: str, request):
        # on the sampler chosen for the adapter (pushed there if missing); one that is down or dies
        # meanwhile is replaced by another; one that evicted the adapter gets it again (samplers.py)
        return await self.backends.call_samplers(target.base_model, method, request, load=lambda sampler: self._ensure_loaded(
            sampler, target.checkpoint_key, target.tenant))

    async def Sample(self, request, context):
        started = unix_ms()
        await self.backends.wait_ready()
        target, sample, tag = await self._sample_call(request)
        response = await self._call_sampler(target, "Sample", sample)
        for i, sequence in enumerate(response.sequences):
            sequence.sequence_id = f"{request.sampler_id}:{tag}:{i}"
        fill_spans(response.sequences, target.weights)
        generated = sum(len(s.tokens) // 4 for s in response.sequences)
        await self._sampled(target, request, generated, started)
        return response

    async def _sample_call(self, request) -> tuple[SamplingTarget, sampler_pb2.SamplerSampleRequest, str]:
        """What Sample and SampleStream check, wait for and send, before any sampler is called:
        (target, the sampler's request, the sequences' tag)."""
        target = await self._sampling_target(request.sampler_id, request.prompt)
        # every rule the sampler applies, before any sampler is called: a refused request pushes no
        # adapter (which could evict the tenant's others) and changes nothing
        check_sampling_params(sampling_with_defaults(request.sampling_params), target.info.vocab_size)
        check_sample_counts(request.num_samples, request.topk_logprobs, request.topk_prompt_logprobs, target.info.vocab_size)
        last_n = request.prompt_logprobs_last_n if request.HasField("prompt_logprobs_last_n") else None
        check_prompt_scoring(len(target.tokens), request.include_prompt_logprobs, request.topk_prompt_logprobs, last_n)
        tag = request.request_tag or uuid.uuid4().hex[:16]
        if not REQUEST_TAG.fullmatch(tag):
            raise InvalidArgument("request_tag: at most 64 letters, digits, '-', '_' or '.'")
        await self._touch(target)
        await self.admission.quotas.wait_to_sample(target.tenant)
        sample = sampler_pb2.SamplerSampleRequest(
            checkpoint_key=target.checkpoint_key, num_samples=request.num_samples, sampling_params=request.sampling_params,
            include_prompt_logprobs=request.include_prompt_logprobs, topk_logprobs=request.topk_logprobs,
            topk_prompt_logprobs=request.topk_prompt_logprobs, deterministic=target.deterministic,
            sampling_session_id=request.sampler_id, tenant=target.tenant,  # the sampler's prefix-cache scope
            weights=target.weights, inflight_run=target.inflight_run,
            pin_version=request.pin_version and bool(target.inflight_run))  # pinning a fixed version changes nothing
        target.to_sampler(sample)
        if last_n is not None:
            sample.prompt_logprobs_last_n = last_n
        return target, sample, tag

    async def SampleStream(self, request, context):
        """Sample's checks, limits and sampler choice (samplers.stream_on_a_sampler: another sampler only
        before the first message), then the sampler's messages as they come, with sequence ids."""
        started = unix_ms()
        await self.backends.wait_ready()
        target, sample, tag = await self._sample_call(request)
        generated, spans = 0, PieceSpans(target.weights)
        try:
            async for chunk in stream_on_a_sampler(self.backends, target.base_model, sample, load=lambda sampler: (
                    self._ensure_loaded(sampler, target.checkpoint_key, target.tenant))):
                for piece in chunk.pieces:
                    piece.sequence_id = f"{request.sampler_id}:{tag}:{piece.index}"
                    spans.fill(piece)
                    generated += len(piece.tokens) // 4
                yield chunk
        finally:  # what was sampled counts, also when the caller left midway
            if generated:
                await asyncio.shield(self._sampled(target, request, generated, started))

    async def _sampled(self, target: SamplingTarget, request, generated: int, started: int) -> None:
        """A Sample's tokens on the tenant's rate, the sampling client's count and the metrics."""
        self.admission.quotas.sampled.record(target.tenant, generated)
        await self._sampling_records.add(SamplingRow(target.session_id, request.sampler_id, "sample", request.num_samples,
                                                     len(target.tokens), generated, started, unix_ms()))  # and the counter
        metrics.TOKENS_SAMPLED.labels(target.tenant).inc(generated)

    async def ComputeLogprobs(self, request, context):
        started = unix_ms()
        await self.backends.wait_ready()
        target = await self._sampling_target(request.sampler_id, request.prompt)
        logprobs = sampler_pb2.SamplerLogprobsRequest(checkpoint_key=target.checkpoint_key, deterministic=target.deterministic)
        target.to_sampler(logprobs)
        if request.HasField("prompt_logprobs_last_n"):
            check_last_n(len(target.tokens), request.prompt_logprobs_last_n)
            logprobs.prompt_logprobs_last_n = request.prompt_logprobs_last_n
        await self._touch(target)
        response = await self._call_sampler(target, "ComputeLogprobs", logprobs)
        await self._sampling_records.add(SamplingRow(target.session_id, request.sampler_id, "compute_logprobs", 0, len(target.tokens),
                                                     0, started, unix_ms()))
        return service_pb2.ComputeLogprobsResponse(logprobs=response.logprobs, weights=target.weights)
