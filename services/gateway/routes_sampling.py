"""Sampling routes: create_sampling_session, samplers/{id}, asample (also how the SDK computes logprobs:
a one-token sample with prompt logprobs)."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request

from temper.services.gateway import convert, fields, image_parts
from temper.services.gateway.app import Result, api_key, fingerprint, gateway, image_limits, json_body
from temper.services.gateway.errors import invalid
from temper.v1 import service_pb2

router = APIRouter(prefix="/api/v1")
# Far above any sampler's own limit (max_num_samples, 64 by default), which refuses more; this one
# only keeps the gateway from listing billions of sequence ids for a request that will be refused.
MAX_NUM_SAMPLES = 4096


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    create = service_pb2.CreateSamplingClientRequest(session_id=fields.string(body, "session_id"))
    fields.integer(body, "sampling_session_seq_id", 0, default=None)  # the scheduler names the sampler
    model_path, base_model = fields.string(body, "model_path", default=None), fields.string(body, "base_model", default=None)
    if model_path:
        create.model_path = model_path
    elif base_model:
        create.base_model = base_model
    else:
        raise invalid("give model_path or base_model")
    sampler = await gw.scheduler.call("CreateSamplingClient", create, key)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    key = api_key(request)
    info = await gateway(request).scheduler.call("GetSamplingClient", service_pb2.GetSamplingClientRequest(sampler_id=sampler_id), key)
    answer = {"sampler_id": info.sampler_id, "base_model": info.base_model, "model_path": info.model_path or None}
    if info.inflight_training_run_id:  # beyond Tinker's fields (its SDK ignores extra ones): the run followed
        answer.update(inflight_training_run_id=info.inflight_training_run_id, min_version=info.min_version)
    return answer


def sample_request(body: dict) -> service_pb2.SampleRequest:
    """The Sample call of an asample body; its sequences' ids are "<sampling_session_id>:<tag>:<i>",
    the tag being the SDK's seq_id (a fresh one for a request without)."""
    if fields.integer(body, "prompt_alt_tokens_k", 0, default=0):
        raise invalid("prompt_alt_tokens_k not supported by Temper yet")
    if body.get("target_prompt_logprobs") is not None:
        raise invalid("target_prompt_logprobs not supported by Temper yet")
    sampler = fields.string(body, "sampling_session_id", default=None)
    if not sampler:
        raise invalid("asample needs a sampling_session_id (create a sampling client first)")
    seq = fields.integer(body, "seq_id", 0, default=None)
    request = service_pb2.SampleRequest(
        sampler_id=sampler, prompt=convert.model_input_from_json(fields.obj(body, "prompt"), "prompt"),
        num_samples=fields.integer(body, "num_samples", 1, MAX_NUM_SAMPLES, default=1),
        sampling_params=convert.sampling_params_from_json(fields.obj(body, "sampling_params", {})),
        include_prompt_logprobs=fields.boolean(body, "prompt_logprobs"),
        topk_logprobs=fields.integer(body, "topk_sample_logprobs", 0, fields.INT32[1], default=0),
        topk_prompt_logprobs=fields.integer(body, "topk_prompt_logprobs", 0, fields.INT32[1], default=0),
        record_stability_info=fields.boolean(body, "record_stability_info"),
        pin_version=fields.boolean(body, "pin_version"),  # Temper's: an in-flight client's sequences on one version
        request_tag=str(seq) if seq is not None else uuid.uuid4().hex[:16])
    last_n = fields.integer(body, "prompt_logprobs_last_n", *fields.INT32, default=None)
    if last_n is not None:
        request.prompt_logprobs_last_n = last_n  # checked by the scheduler
    return request


@router.post("/asample")
async def asample(request: Request):
    """A request with a seq_id is one per (sampler, seq_id): resent, it joins the first; one without
    is never joined with another."""
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    sample = sample_request(body)
    if any(c.HasField("image") for c in sample.prompt.chunks):
        await asyncio.to_thread(image_parts.check_images, [sample.prompt], image_limits(request), "prompt")
    request_id = f"{sample.sampler_id}:{sample.request_tag}"
    sequence_ids = [f"{request_id}:{i}" for i in range(sample.num_samples)]  # as the scheduler names them

    async def work():
        resp = await gw.scheduler.verb("Sample", sample, key)
        return Result(json=lambda: convert.sample_to_json(resp), proto=lambda: convert.sample_to_wire(resp))

    return gw.submit(key, request_id, work, await fingerprint(request), sample_sequence_ids=sequence_ids)


@router.post("/cancel_future")
async def cancel_future():
    return {}  # sample_cancel_enabled is off; a cancelled sample simply runs to its end
