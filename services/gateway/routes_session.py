"""Bootstrap and session routes: client config, sessions, heartbeats, telemetry, health, capabilities."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from temper.services.gateway import convert
from temper.services.gateway.app import api_key, gateway, json_body
from temper.services.gateway.errors import GatewayError
from temper.v1 import service_pb2

router = APIRouter(prefix="/api/v1")

# Every flag at the SDK's conservative default; spelled out so a reader sees what we rely on: API keys
# (no JWT exchange), per-request retrieve_future polling, client-side custom losses, no sampling-session
# joins, uncompressed forward_backward bodies.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "custom_loss_server_side": False, "sample_join_sampling_session": False}


@router.post("/client/config")
async def client_config():
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def dynamic_config():
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.post("/telemetry")
async def telemetry():
    return {"status": "accepted"}  # the SDK's usage events are not kept


@router.get("/get_server_capabilities")
async def server_capabilities(request: Request):
    resp = await gateway(request).scheduler.call("GetServerCapabilities", service_pb2.GetServerCapabilitiesRequest(), api_key(request))
    return convert.capabilities_to_json(resp)


@router.post("/create_session")
async def create_session(request: Request):
    body = await json_body(request)
    metadata = {str(k): str(v) for k, v in (body.get("user_metadata") or {}).items()}
    tags = [str(tag) for tag in body.get("tags") or []]
    session = await gateway(request).scheduler.call("CreateSession", service_pb2.CreateSessionRequest(tags=tags, user_metadata=metadata),
                                                    api_key(request))
    return {"type": "create_session", "session_id": session.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request):
    body = await json_body(request)
    try:
        await gateway(request).scheduler.call("Heartbeat", service_pb2.HeartbeatRequest(session_id=body.get("session_id", "")),
                                              api_key(request))
    except GatewayError as error:
        if error.code == grpc.StatusCode.FAILED_PRECONDITION:  # closed: 410 ends the SDK's heartbeat loop
            return JSONResponse({"error": error.message}, status_code=410)
        raise
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request):
    body = await json_body(request)
    status = (body.get("reason") or {}).get("type", "success")
    try:
        await gateway(request).scheduler.call("CloseSession", service_pb2.CloseSessionRequest(session_id=session_id, status=status),
                                              api_key(request))
    except GatewayError as error:
        if error.code != grpc.StatusCode.FAILED_PRECONDITION:  # already closed is done
            raise
    return {}
