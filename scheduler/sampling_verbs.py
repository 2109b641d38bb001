"""The sampling verbs of the public API: sampling clients, Sample, ComputeLogprobs.

A sampling client belongs to its session's tenant; it samples the base model, one of the tenant's
checkpoints, or a checkpoint another tenant published. Sampling over the tenant's tokens per minute
waits (quotas.py); a closed session's sampling clients answer FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from temper.common.checkpoints import parse_path
from temper.common.codec import decode_tokens
from temper.common.errors import FailedPrecondition, InvalidArgument, NotFound
from temper.common.validation import check_token_range, model_input_tokens
from temper.scheduler import metrics
from temper.scheduler.auth import caller
from temper.scheduler.backends import SamplerHandle
from temper.scheduler.db import models as m
from temper.v1 import sampler_pb2, service_pb2, types_pb2

TOUCH_SECONDS = 60.0  # a checkpoint's last use by a sampling client is written at most this often


@dataclass
class SamplingTarget:
    sampler: SamplerHandle
    checkpoint_key: str     # "" for the base model
    tokens: np.ndarray      # the prompt
    tenant: str


class SamplingVerbs:
    """Mixed into TemperServicer (store, backends, runs, admission come from it)."""

    def _init_sampling(self) -> None:
        self._samplers: dict[str, tuple[m.SamplingClient, str]] = {}  # sampler id -> (row, tenant)
        self._touched: dict[str, float] = {}

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
            sampler = self.backends.sampler_for(base_model)
            await self._ensure_loaded(sampler, path.key, tenant)
            await asyncio.to_thread(self.store.touch_checkpoint, model_path)
        elif source == "base_model":
            base_model, model_path = request.base_model, None
            sampler = self.backends.sampler_for(base_model)
        else:
            raise InvalidArgument("give base_model or model_path")
        row = await asyncio.to_thread(self.store.add_sampling_client, request.session_id, base_model, model_path)
        self._samplers[row.id] = (row, tenant)
        return service_pb2.SamplingClientInfo(
            sampler_id=row.id, base_model=base_model, model_path=model_path or "", tokenizer_id=sampler.info.tokenizer_id,
            vocab_size=sampler.info.vocab_size,
        )

    async def _ensure_loaded(self, sampler: SamplerHandle, key: str, tenant: str) -> None:
        """The checkpoint's adapter on ``sampler``, within the tenant's resident-adapter limit."""
        path = parse_path(f"tinker://{key}")
        if key not in sampler.loaded:  # still there, and still the caller's to read (deleted, collected, unpublished)
            await asyncio.to_thread(self.store.readable_checkpoint, str(path), tenant)
        run = await self.runs.get(path.training_run_id)
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
        sampler = self.backends.sampler_for(row.base_model)
        checkpoint_key = ""
        if row.model_path:
            checkpoint_key = parse_path(row.model_path).key
            await self._ensure_loaded(sampler, checkpoint_key, tenant)  # e.g. after a sampler restart or eviction
            if time.monotonic() - self._touched.get(row.model_path, 0.0) > TOUCH_SECONDS:
                self._touched[row.model_path] = time.monotonic()
                await asyncio.to_thread(self.store.touch_checkpoint, row.model_path)
        tokens = model_input_tokens(prompt)
        if tokens.size == 0:
            raise InvalidArgument("prompt is empty")
        check_token_range(tokens, sampler.info.vocab_size, "prompt")
        if len(tokens) > sampler.info.max_context_length:
            raise InvalidArgument(f"prompt has {len(tokens)} tokens; the context length is {sampler.info.max_context_length}")
        return SamplingTarget(sampler, checkpoint_key, tokens, tenant)

    async def _call_sampler(self, target: SamplingTarget, method: str, request):
        # a sampler that evicted the adapter (or restarted) gets it pushed again, then the call is retried once
        return await self.backends.sample_call(target.sampler, method, request, reload=lambda: self._ensure_loaded(
            target.sampler, target.checkpoint_key, target.tenant))

    async def Sample(self, request, context):
        await self.backends.wait_ready()
        target = await self._sampling_target(request.sampler_id, request.prompt)
        if request.num_samples < 1:
            raise InvalidArgument(f"num_samples must be >= 1, got {request.num_samples}")
        check_token_range(decode_tokens(request.sampling_params.stop_token_ids), target.sampler.info.vocab_size, "stop token ids")
        await self.admission.quotas.wait_to_sample(target.tenant)
        response = await self._call_sampler(target, "Sample", sampler_pb2.SamplerSampleRequest(
            checkpoint_key=target.checkpoint_key, prompt_tokens=target.tokens.astype("<i4").tobytes(),
            num_samples=request.num_samples, sampling_params=request.sampling_params,
            include_prompt_logprobs=request.include_prompt_logprobs, topk_logprobs=request.topk_logprobs,
        ))
        generated = sum(len(s.tokens) // 4 for s in response.sequences)
        self.admission.quotas.sampled.record(target.tenant, generated)
        await asyncio.to_thread(self.store.add_sampled_tokens, request.sampler_id, generated)
        metrics.TOKENS_SAMPLED.labels(target.tenant).inc(generated)
        return response

    async def ComputeLogprobs(self, request, context):
        await self.backends.wait_ready()
        target = await self._sampling_target(request.sampler_id, request.prompt)
        response = await self._call_sampler(target, "ComputeLogprobs", sampler_pb2.SamplerLogprobsRequest(
            checkpoint_key=target.checkpoint_key, prompt_tokens=target.tokens.astype("<i4").tobytes()))
        return service_pb2.ComputeLogprobsResponse(logprobs=response.logprobs)
