"""Sampling routes: create_sampling_session, samplers/{id}, asample (also how the SDK computes logprobs:
a one-token sample with prompt logprobs)."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request

from temper.services.gateway import convert
from temper.services.gateway.app import Result, api_key, gateway, json_body
from temper.services.gateway.errors import GatewayError, invalid
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
    gw.remember_sampler(sampler.sampler_id, sampler.base_model, sampler.model_path)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    api_key(request)
    info = gateway(request).samplers.get(sampler_id)
    if info is None:
        raise GatewayError(grpc.StatusCode.NOT_FOUND, f"sampler {sampler_id!r} is unknown to this gateway (made elsewhere, "
                                                      "or before it restarted)")
    return {"sampler_id": sampler_id, "base_model": info.base_model, "model_path": info.model_path}


def sample_request(body: dict) -> tuple[service_pb2.SampleRequest, int | None]:
    """The Sample call of an asample body, and its prompt_logprobs_last_n (applied to the answer)."""
    unsupported = [name for name in ("topk_prompt_logprobs", "prompt_alt_tokens_k") if body.get(name)]
    if body.get("target_prompt_logprobs") is not None:
        unsupported.append("target_prompt_logprobs")
    if unsupported:
        raise invalid(f"{', '.join(unsupported)} not supported by Temper yet")
    if not body.get("sampling_session_id"):
        raise invalid("asample needs a sampling_session_id (create a sampling client first)")
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None and (not body.get("prompt_logprobs") or int(last_n) < 1):
        raise invalid("prompt_logprobs_last_n needs prompt_logprobs and must be >= 1")
    request = service_pb2.SampleRequest(
        sampler_id=body["sampling_session_id"], prompt=convert.model_input_from_json(body.get("prompt") or {}),
        num_samples=int(body.get("num_samples", 1)), sampling_params=convert.sampling_params_from_json(body.get("sampling_params") or {}),
        include_prompt_logprobs=bool(body.get("prompt_logprobs")), topk_logprobs=int(body.get("topk_sample_logprobs") or 0))
    return request, None if last_n is None else int(last_n)


@router.post("/asample")
async def asample(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    sample, last_n = sample_request(body)
    request_id = f"{sample.sampler_id}:{int(body.get('seq_id') or 0)}"
    sequence_ids = [f"{request_id}:{i}" for i in range(sample.num_samples)]

    async def work():
        resp = await gw.scheduler.verb("Sample", sample, key)
        return Result(json=lambda: convert.sample_to_json(resp, sequence_ids, last_n),
                      proto=lambda: convert.sample_to_wire(resp, last_n))

    return gw.submit(key, request_id, work, sample_sequence_ids=sequence_ids)


@router.post("/cancel_future")
async def cancel_future():
    return {}  # sample_cancel_enabled is off; a cancelled sample simply runs to its end
