"""The routes of the SDK's RestClient: training runs, checkpoints (0.39's search too), weights info
(external_weights_urls: routes_downloads.py).

A checkpoint id is ``<weights|sampler_weights|external_weights>/<name>``, so it spans two path segments here. Every
route reads the API key before anything else, so a call without one is 401 whatever it sends.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from temper.common import checkpoint_search
from temper.common.checkpoints import parse_path
from temper.services.gateway import convert, fields
from temper.services.gateway.app import api_key, gateway, json_body
from temper.services.gateway.errors import invalid
from temper.services.gateway.idempotent import once_per_request
from temper.v1 import service_pb2

router = APIRouter(prefix="/api/v1")
RUNS_PATH = "/training_runs/{run_id}/checkpoints/{kind}/{name}"


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    """``limit`` and ``offset`` query parameters: decimal integers in [0, 2**31 - 1] (the scheduler's int32)."""
    hi = fields.INT32[1]
    values = []
    for name, default in (("limit", default_limit), ("offset", 0)):
        raw = request.query_params.get(name, str(default))
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 10 and int(raw) <= hi):
            raise invalid(f"limit and offset are integers in [0, {hi}]")
        values.append(int(raw))
    return values[0], values[1]


async def _checkpoints(request: Request, run_id: str = "") -> list:
    resp = await gateway(request).scheduler.call("ListCheckpoints", service_pb2.ListCheckpointsRequest(training_run_id=run_id),
                                                 api_key(request))
    return sorted(resp.checkpoints, key=lambda c: c.created_unix_ms)


async def _info(request: Request, run_id: str):
    return await gateway(request).scheduler.call("GetInfo", service_pb2.GetInfoRequest(training_run_id=run_id), api_key(request))


@router.get("/training_runs")
async def list_training_runs(request: Request):
    api_key(request)
    limit, offset = _page(request, 20)
    project_id = fields.text(request.query_params.get("project_id", ""), "project_id")  # 404: not one of the caller's
    if limit == 0:
        listed = await gateway(request).scheduler.call("ListTrainingRuns", service_pb2.ListTrainingRunsRequest(
            limit=1, project_id=project_id), api_key(request))
        return {"training_runs": [], "cursor": {"offset": offset, "limit": 0, "total_count": listed.total_count}}
    listed = await gateway(request).scheduler.call("ListTrainingRuns", service_pb2.ListTrainingRunsRequest(
        limit=min(limit, 1000), offset=offset, project_id=project_id), api_key(request))
    checkpoints = await _checkpoints(request) if listed.training_runs else []
    runs = [convert.training_run_to_json(info, [c for c in checkpoints if c.training_run_id == info.training_run_id])
            for info in listed.training_runs]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": listed.total_count}}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request):
    api_key(request)
    info = await _info(request, run_id)
    return convert.training_run_to_json(info, await _checkpoints(request, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request):
    return {"checkpoints": [convert.checkpoint_to_json(c) for c in await _checkpoints(request, run_id)]}


@router.get("/checkpoints")
async def list_user_checkpoints(request: Request):
    api_key(request)
    limit, offset = _page(request, 100)
    everything = await _checkpoints(request)
    return {"checkpoints": [convert.checkpoint_to_json(c) for c in everything[offset: offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(everything)}}


@router.post("/checkpoints/search")
async def search_checkpoints(request: Request):
    """Tinker 0.39's RestClient.search_checkpoints: the body is its CheckpointSearchRequest (see
    temper.common.checkpoint_search), the answer a CheckpointSearchResponse, newest first."""
    api_key(request)
    try:
        query = checkpoint_search.parse_query(await json_body(request))
    except ValueError as exc:
        raise invalid(str(exc)) from None
    caller = None
    if query.owner == "user":
        runs = await gateway(request).scheduler.call("ListTrainingRuns", service_pb2.ListTrainingRunsRequest(limit=1), api_key(request))
        caller = checkpoint_search.owner_of(runs.training_runs)
    listed = await gateway(request).scheduler.call(
        "ListCheckpoints", service_pb2.ListCheckpointsRequest(project_ids=query.project_ids), api_key(request))
    page, next_cursor = checkpoint_search.search(listed.checkpoints, query, caller)
    return {"checkpoints": [convert.checkpoint_to_json(c) for c in page], "next_cursor": next_cursor}


@router.post("/weights_info")
async def weights_info(request: Request):
    key, body = api_key(request), await json_body(request)
    path = str(parse_path(fields.string(body, "tinker_path")))
    checkpoint = await gateway(request).scheduler.call("GetCheckpoint", service_pb2.GetCheckpointRequest(path=path), key)
    return convert.weights_info_to_json(checkpoint)


def _path(request: Request, run_id: str, kind: str, name: str) -> str:
    api_key(request)
    return str(parse_path(convert.tinker_path(run_id, f"{kind}/{name}")))


async def _once(request: Request, method: str, message) -> None:
    """One scheduler call that changes a checkpoint; a resend of it (same X-Idempotency-Key) is answered
    without a second change (idempotent.py)."""
    key = api_key(request)

    async def make():
        return await gateway(request).scheduler.call(method, message, key)

    await once_per_request(request, key, message.SerializeToString(), make)


async def _update(request: Request, path: str, **changes) -> None:
    await _once(request, "UpdateCheckpoint", service_pb2.UpdateCheckpointRequest(path=path, **changes))


@router.delete(RUNS_PATH)
async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request):
    path = _path(request, run_id, kind, name)
    await _once(request, "DeleteCheckpoint", service_pb2.DeleteCheckpointRequest(path=path))
    return None


@router.post(RUNS_PATH + "/publish")
async def publish_checkpoint(run_id: str, kind: str, name: str, request: Request):
    await _update(request, _path(request, run_id, kind, name), published=True)
    return None


@router.delete(RUNS_PATH + "/publish")
async def unpublish_checkpoint(run_id: str, kind: str, name: str, request: Request):
    await _update(request, _path(request, run_id, kind, name), published=False)
    return None


@router.put(RUNS_PATH + "/ttl")
async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request):
    path = _path(request, run_id, kind, name)
    ttl = fields.integer(await json_body(request), "ttl_seconds", default=0)  # the scheduler checks its range
    await _update(request, path, ttl_seconds=ttl)
    return None
