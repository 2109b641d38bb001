"""The console's tenant routes: who am I, usage, training runs (with their steps and checkpoints),
checkpoints and their changes. Each answers from the scheduler with the caller's key
(``X-API-Key``), so a tenant sees its own things only and another tenant's id is 404."""

from __future__ import annotations

from fastapi import APIRouter, Request

from temper.services.gateway import fields
from temper.services.gateway.app import api_key, gateway
from temper.services.gateway.console import forms
from temper.services.gateway.console.views import view
from temper.services.gateway.errors import invalid
from temper.v1 import records_pb2, service_pb2

router = APIRouter(prefix="/console/api")
MAX_PAGE = 200


async def call(request: Request, method: str, message):
    """One scheduler call with the caller's key (read first: no key is 401 whatever else is wrong)."""
    return await gateway(request).scheduler.call(method, message, api_key(request))


def query_int(request: Request, name: str, default: int, lo: int = 0, hi: int = fields.INT32[1]) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not (raw.lstrip("-").isascii() and raw.lstrip("-").isdigit() and len(raw) <= 20) or not lo <= int(raw) <= hi:
        raise invalid(f"{name} must be an integer in [{lo}, {hi}]")
    return int(raw)


@router.get("/usage")
async def usage(request: Request):
    return view(await call(request, "GetUsage", service_pb2.GetUsageRequest()))


def _run_json(info, steps: dict[str, dict]) -> dict:
    out = view(info)
    out.update(steps.get(info.training_run_id, {"steps": 0, "tokens_trained": 0}))
    return out


def _run_usage(usage) -> dict[str, dict]:
    return {r.training_run_id: {"steps": r.steps, "tokens_trained": r.tokens_trained} for r in usage.runs}


@router.get("/runs")
async def runs(request: Request):
    api_key(request)
    limit, offset = query_int(request, "limit", 50, 1, MAX_PAGE), query_int(request, "offset", 0)
    listed = await call(request, "ListTrainingRuns", service_pb2.ListTrainingRunsRequest(limit=limit, offset=offset))
    steps = _run_usage(await call(request, "GetUsage", service_pb2.GetUsageRequest()))
    states = await _session_states(request, {session_of(i.training_run_id) for i in listed.training_runs})
    runs = [{**_run_json(info, steps), "status": states.get(session_of(info.training_run_id), "")}
            for info in listed.training_runs]
    return {"runs": runs, "total_count": listed.total_count, "limit": limit, "offset": offset}


def session_of(run_id: str) -> str:
    return run_id.rsplit(":train:", 1)[0]


async def _session_states(request: Request, session_ids: set[str]) -> dict[str, str]:
    """A run's status is its session's: "open" (heartbeats keep it) or "closed (<status>)"."""
    states = {}
    for session_id in sorted(session_ids):
        info = await call(request, "GetSession", records_pb2.GetSessionRequest(session_id=session_id))
        states[session_id] = f"closed ({info.close_status or 'unknown'})" if info.closed else "open"
    return states


@router.get("/runs/{run_id}")
async def run(run_id: str, request: Request):
    api_key(request)
    fields.text(run_id, "run id")
    info = await call(request, "GetInfo", service_pb2.GetInfoRequest(training_run_id=run_id))
    steps = _run_usage(await call(request, "GetUsage", service_pb2.GetUsageRequest()))
    checkpoints = await call(request, "ListCheckpoints", service_pb2.ListCheckpointsRequest(training_run_id=run_id,
                                                                                            include_temporary=True))
    return {"run": _run_json(info, steps), "checkpoints": [view(c) for c in checkpoints.checkpoints]}


@router.get("/checkpoints")
async def checkpoints(request: Request):
    listed = await call(request, "ListCheckpoints", service_pb2.ListCheckpointsRequest(include_temporary=True))
    return {"checkpoints": [view(c) for c in sorted(listed.checkpoints, key=lambda c: -c.created_unix_ms)]}


@router.post("/checkpoints/publish")
async def publish(request: Request):
    api_key(request)
    form = await forms.read(request, forms.PublishForm)
    changed = await call(request, "UpdateCheckpoint",
                         service_pb2.UpdateCheckpointRequest(path=form.checked_path(), published=form.published))
    return view(changed)


@router.post("/checkpoints/ttl")
async def set_ttl(request: Request):
    api_key(request)
    form = await forms.read(request, forms.TtlForm)
    changed = await call(request, "UpdateCheckpoint",
                         service_pb2.UpdateCheckpointRequest(path=form.checked_path(), ttl_seconds=form.ttl_seconds))
    return view(changed)


@router.post("/checkpoints/delete")
async def delete(request: Request):
    api_key(request)
    form = await forms.read(request, forms.CheckpointForm)
    freed = await call(request, "DeleteCheckpoint", service_pb2.DeleteCheckpointRequest(path=form.checked_path()))
    return {"freed_bytes": freed.freed_bytes}


@router.get("/models")
async def models(request: Request):
    """What the Playground can chat with: the base models, and the tenant's sampler checkpoints (the
    temporary ones too, until they are collected)."""
    caps = await call(request, "GetServerCapabilities", service_pb2.GetServerCapabilitiesRequest())
    listed = await call(request, "ListCheckpoints", service_pb2.ListCheckpointsRequest(include_temporary=True))
    sampler = [c for c in listed.checkpoints if c.checkpoint_id.startswith("sampler_weights/")]
    return {"base_models": [m.model_name for m in caps.supported_models if m.sampleable],
            "checkpoints": [{"path": c.path, "base_model": c.base_model, "temporary": c.temporary,
                             "expires_unix_ms": c.expires_unix_ms}
                            for c in sorted(sampler, key=lambda c: -c.created_unix_ms)]}
