"""Sampling routes: create_sampling_session, samplers/{id}, asample (also how the SDK computes logprobs:
a one-token sample with prompt logprobs)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from temper.services.gateway import convert
from temper.services.gateway.app import Result, api_key, gateway, json_body
from temper.services.gateway.errors import invalid
from temper.v1 import service_pb2

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    gw, body = gateway(request), await json_body(request)
    create = service_pb2.CreateSamplingClientRequest(session_id=body.get("session_id", ""))
    if body.get("model_path"):
        create.model_path = body["model_path"]
    elif body.get("base_model"):
        create.base_model = body["base_model"]
    else:
        raise invalid("give model_path or base_model")
    sampler = await gw.scheduler.call("CreateSamplingClient", create, api_key(request))
    return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    info = await gateway(request).scheduler.call("GetSamplingClient", service_pb2.GetSamplingClientRequest(sampler_id=sampler_id),
                                                 api_key(request))
    return {"sampler_id": info.sampler_id, "base_model": info.base_model, "model_path": info.model_path or None}


def sample_request(body: dict) -> service_pb2.SampleRequest:
    """The Sample call of an asample body; its sequences' ids are "<sampling_session_id>:<seq_id>:<i>"."""
    unsupported = [name for name in ("prompt_alt_tokens_k",) if body.get(name)]
    if body.get("target_prompt_logprobs") is not None:
        unsupported.append("target_prompt_logprobs")
    if unsupported:
        raise invalid(f"{', '.join(unsupported)} not supported by Temper yet")
    if not body.get("sampling_session_id"):
        raise invalid("asample needs a sampling_session_id (create a sampling client first)")
    request = service_pb2.SampleRequest(
        sampler_id=body["sampling_session_id"], prompt=convert.model_input_from_json(body.get("prompt") or {}),
        num_samples=int(body.get("num_samples", 1)), sampling_params=convert.sampling_params_from_json(body.get("sampling_params") or {}),
        include_prompt_logprobs=bool(body.get("prompt_logprobs")), topk_logprobs=int(body.get("topk_sample_logprobs") or 0),
        topk_prompt_logprobs=int(body.get("topk_prompt_logprobs") or 0), record_stability_info=bool(body.get("record_stability_info")),
        request_tag=str(int(body.get("seq_id") or 0)))
    if body.get("prompt_logprobs_last_n") is not None:
        request.prompt_logprobs_last_n = int(body["prompt_logprobs_last_n"])  # checked by the scheduler
    return request


@router.post("/asample")
async def asample(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    sample = sample_request(body)
    request_id = f"{sample.sampler_id}:{sample.request_tag}"
    sequence_ids = [f"{request_id}:{i}" for i in range(sample.num_samples)]  # as the scheduler names them

    async def work():
        resp = await gw.scheduler.verb("Sample", sample, key)
        return Result(json=lambda: convert.sample_to_json(resp), proto=lambda: convert.sample_to_wire(resp))

    return gw.submit(key, request_id, work, sample_sequence_ids=sequence_ids)


@router.post("/cancel_future")
async def cancel_future():
    return {}  # sample_cancel_enabled is off; a cancelled sample simply runs to its end
