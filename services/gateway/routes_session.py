"""Bootstrap and session routes: client config, sessions, heartbeats, telemetry, health, capabilities."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from temper.services.gateway import convert, fields
from temper.services.gateway.app import api_key, gateway, json_body
from temper.services.gateway.errors import GatewayError, bounded
from temper.v1 import service_pb2

router = APIRouter(prefix="/api/v1")

# Spelled out so a reader sees what we rely on: JWT auth (the SDK exchanges its API key for a short-lived
# JWT at /auth/token and sends that; the SDK's default), per-request retrieve_future polling, client-side
# custom losses, no sampling-session joins, uncompressed forward_backward bodies.
CLIENT_CONFIG = {"pjwt_auth_enabled": True, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "custom_loss_server_side": False, "sample_join_sampling_session": False}


@router.post("/client/config")
async def client_config():
    return CLIENT_CONFIG


@router.post("/auth/token")
async def auth_token(request: Request):
    """The SDK's key-for-JWT exchange: the scheduler signs a token for the calling API key (CreateAuthToken)."""
    key = api_key(request)
    gw = gateway(request)
    token = await gw.scheduler.call("CreateAuthToken", service_pb2.CreateAuthTokenRequest(), key)
    gw.futures.bind_token(token.jwt, key, token.expires_unix_ms / 1000)  # futures stay the key's across renewals
    return {"jwt": token.jwt}


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
    key = api_key(request)
    resp = await gateway(request).scheduler.call("GetServerCapabilities", service_pb2.GetServerCapabilitiesRequest(), key)
    return convert.capabilities_to_json(resp)


@router.post("/create_session")
async def create_session(request: Request):
    key, body = api_key(request), await json_body(request)
    # display_name, project_id: ServiceClient(display_name=..., project_id=...); the scheduler bounds the
    # name (256 characters, no control characters) and answers 404 for a project not the caller's
    create = service_pb2.CreateSessionRequest(tags=fields.strings(body, "tags", default=[]),
                                              user_metadata=convert.metadata_from_json(body),
                                              display_name=fields.string(body, "display_name", default=""),
                                              project_id=fields.string(body, "project_id", default=""))
    session = await gateway(request).scheduler.call("CreateSession", create, key)
    return {"type": "create_session", "session_id": session.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request):
    key, body = api_key(request), await json_body(request)
    try:
        await gateway(request).scheduler.call("Heartbeat", service_pb2.HeartbeatRequest(session_id=fields.string(body, "session_id")),
                                              key)
    except GatewayError as error:
        if error.code == grpc.StatusCode.FAILED_PRECONDITION:  # closed: 410 ends the SDK's heartbeat loop
            return JSONResponse({"error": bounded(error.message)}, status_code=410)
        raise
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request):
    key, body = api_key(request), await json_body(request)
    # the scheduler checks the value: success, errored or interrupted
    status = fields.string(fields.obj(body, "reason", {}), "type", default="success", where="reason.")
    try:
        await gateway(request).scheduler.call("CloseSession", service_pb2.CloseSessionRequest(session_id=session_id, status=status),
                                              key)
    except GatewayError as error:
        if error.code != grpc.StatusCode.FAILED_PRECONDITION:  # already closed is done
            raise
    return {}
