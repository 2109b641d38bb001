"""Training routes: create_model, get_info, the sequenced verbs, save/load, and retrieve_future.

A sequenced verb keeps the SDK's seq_id (the scheduler runs a run's requests in that order and
answers a resent (run, seq) with its first answer). A request the gateway itself refuses after
reading its seq still spends that seq at the scheduler, so the run's later requests do not wait on
a gap (``_spend``).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from temper.common.errors import TemperError
from temper.services.gateway import convert
from temper.services.gateway.app import Gateway, Result, api_key, gateway, json_body
from temper.services.gateway.errors import GatewayError, invalid
from temper.v1 import service_pb2, types_pb2

router = APIRouter(prefix="/api/v1")


async def _spend(gw: Gateway, key: str, run: str, seq: int, error: GatewayError) -> None:
    """Send an empty forward_backward under ``seq`` (refused at once, which spends it), then fail with ``error``."""
    empty = service_pb2.ForwardBackwardRequest(training_run_id=run, seq_id=seq, loss_fn="cross_entropy")
    try:
        await gw.scheduler.verb("ForwardBackward", empty, key)
    except GatewayError:
        pass
    raise error


def _sequenced(gw: Gateway, key: str, run: str, sdk_seq: int, build, method: str, render) -> dict:
    """Submit one sequenced verb: ``build(seq)`` makes the request (a GatewayError from it spends the
    seq), ``render(response)`` the Result."""
    seq = sdk_seq

    async def work():
        try:
            request = build(seq)
        except (GatewayError, TemperError) as exc:
            await _spend(gw, key, run, seq, GatewayError.of(exc))
        return render(await gw.scheduler.verb(method, request, key))

    return gw.submit(key, f"{run}:{sdk_seq}", work)


# ---- runs ----------------------------------------------------------------------------------------

@router.post("/create_model")
async def create_model(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    convert.check_optimizer_config(body.get("optimizer_config"))
    session, model_seq_id = body.get("session_id", ""), int(body.get("model_seq_id") or 0)
    create = service_pb2.CreateTrainingRunRequest(
        session_id=session, base_model=body.get("base_model", ""), lora_config=convert.lora_from_json(body.get("lora_config") or {}),
        user_metadata=convert.metadata_from_json(body.get("user_metadata")))
    if body.get("model_seq_id") is not None:
        create.run_index = model_seq_id  # the run id the SDK computes: <session>:train:<model_seq_id>

    async def work():
        info = await gw.scheduler.verb("CreateTrainingRun", create, key)
        return Result(json=lambda: {"type": "create_model", "model_id": info.training_run_id})

    return gw.submit(key, f"{session}:create_model:{model_seq_id}", work)


@router.post("/get_info")
async def get_info(request: Request):
    gw, body = gateway(request), await json_body(request)
    info = await gw.scheduler.call("GetInfo", service_pb2.GetInfoRequest(training_run_id=body.get("model_id", "")), api_key(request))
    return convert.info_to_json(info)


# ---- forward / backward / optim ------------------------------------------------------------------

def _fwdbwd_result(out) -> Result:
    return Result(json=lambda: convert.forward_backward_to_json(out), proto=lambda: convert.forward_backward_to_wire(out))


@router.post("/forward_backward")
async def forward_backward(request: Request):
    """Protobuf (SDK >= 0.22.3) or JSON (older SDKs) body."""
    gw, key = gateway(request), api_key(request)
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise invalid("compressed forward_backward bodies are not accepted (client config proto_compress_fwdbwd is off)")
    if "protobuf" in request.headers.get("content-type", ""):
        msg = convert.parse_forward_backward(await request.body())
        run, sdk_seq = msg.model_id, msg.seq_id

        def build(seq):
            out = convert.forward_backward_from_wire(msg)
            out.training_run_id, out.seq_id = run, seq
            return out
    else:
        body = await json_body(request)
        run, sdk_seq = body.get("model_id", ""), int(body.get("seq_id") or 0)

        def build(seq):
            out = convert.forward_backward_from_json(body, forward_only=False)
            out.seq_id = seq
            return out
    return _sequenced(gw, key, run, sdk_seq, build, "ForwardBackward", _fwdbwd_result)


@router.post("/forward")
async def forward(request: Request):
    """SDKs before 0.25 send forward passes here, as JSON."""
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    run, sdk_seq = body.get("model_id", ""), int(body.get("seq_id") or 0)

    def build(seq):
        out = convert.forward_backward_from_json(body, forward_only=True)
        out.seq_id = seq
        return out

    return _sequenced(gw, key, run, sdk_seq, build, "ForwardBackward", _fwdbwd_result)


@router.post("/optim_step")
async def optim_step(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    run, sdk_seq = body.get("model_id", ""), int(body.get("seq_id") or 0)

    def build(seq):
        return service_pb2.OptimStepRequest(training_run_id=run, seq_id=seq, adam_params=convert.adam_from_json(body))

    def render(resp):
        return Result(json=lambda: {"type": "optim_step", "metrics": {convert.metric_key(k): v for k, v in resp.metrics.items()}})

    return _sequenced(gw, key, run, sdk_seq, build, "OptimStep", render)


# ---- checkpoints ---------------------------------------------------------------------------------

def _save_request(body: dict, seq: int, kind: int, name: str, ephemeral: bool = False,
                  overwrite: bool = False) -> service_pb2.SaveWeightsRequest:
    return service_pb2.SaveWeightsRequest(training_run_id=body.get("model_id", ""), seq_id=seq, name=name, kind=kind,
                                          ttl_seconds=int(body.get("ttl_seconds") or 0), ephemeral=ephemeral, overwrite=overwrite,
                                          user_metadata=convert.metadata_from_json(body.get("user_metadata")))


@router.post("/save_weights")
async def save_weights(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    run, sdk_seq = body.get("model_id", ""), int(body.get("seq_id") or 0)

    def build(seq):
        return _save_request(body, seq, types_pb2.CHECKPOINT_KIND_TRAINING, body.get("path") or f"state-{sdk_seq}",
                             overwrite=bool(body.get("overwrite")))

    def render(resp):
        return Result(json=lambda: {"type": "save_weights", "path": resp.checkpoint.path})

    return _sequenced(gw, key, run, sdk_seq, build, "SaveWeights", render)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request):
    """Named (``path``: a listed sampler checkpoint) or ephemeral (``sampling_session_seq_id``: an
    unlisted snapshot, answered with a sampling client on it)."""
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    run, sdk_seq = body.get("model_id", ""), int(body.get("seq_id") or 0)
    seq = sdk_seq
    named = body.get("path") is not None

    async def work():
        if body.get("kind", "snapshot") != "snapshot":
            await _spend(gw, key, run, seq, invalid(f"sampler kind {body.get('kind')!r} is not supported by Temper (snapshot only)"))
        name = body["path"] if named else f"ephemeral-{sdk_seq}-{uuid.uuid4().hex[:8]}"
        saved = await gw.scheduler.verb("SaveWeights", _save_request(body, seq, types_pb2.CHECKPOINT_KIND_SAMPLER, name,
                                                                     ephemeral=not named), key)
        if named:
            return Result(json=lambda: {"type": "save_weights_for_sampler", "path": saved.checkpoint.path})
        sampler = await gw.scheduler.verb("CreateSamplingClient", service_pb2.CreateSamplingClientRequest(
            session_id=convert.session_of(run), model_path=saved.checkpoint.path), key)
        return Result(json=lambda: {"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id})

    return gw.submit(key, f"{run}:{sdk_seq}", work)


@router.post("/save_weights_external")
async def save_weights_external(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    run, sdk_seq = body.get("model_id", ""), int(body.get("seq_id") or 0)

    def build(seq):
        raise invalid("save_weights_external is not supported by Temper yet (download a checkpoint with temper.client)")

    return _sequenced(gw, key, run, sdk_seq, build, "SaveWeights", lambda resp: None)


@router.post("/load_weights")
async def load_weights(request: Request):
    """On a run (``model_id`` + ``seq_id``), or creating one from the checkpoint (``session_id`` +
    ``model_seq_id``: the SDK's create_training_client_from_state[_with_optimizer])."""
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    path, optimizer = body.get("path", ""), bool(body.get("optimizer"))
    if body.get("model_id"):
        run, sdk_seq = body["model_id"], int(body.get("seq_id") or 0)

        def build(seq):
            return service_pb2.LoadWeightsRequest(training_run_id=run, seq_id=seq, path=path, with_optimizer=optimizer)

        def render(resp):
            return Result(json=lambda: {"type": "load_weights", "path": resp.path or path, "model_id": run})

        return _sequenced(gw, key, run, sdk_seq, build, "LoadWeights", render)
    session, model_seq_id = body.get("session_id", ""), int(body.get("model_seq_id") or 0)
    convert.check_optimizer_config(body.get("optimizer_config"))
    # One call: the scheduler takes the LoRA config from the checkpoint (also another tenant's published
    # one) and loads it as part of creation, using no seq, so the SDK's seq 1 is the run's seq 1.
    create = service_pb2.CreateTrainingRunRequest(
        session_id=session, base_model=body.get("base_model") or "", from_path=path, with_optimizer=optimizer,
        run_index=model_seq_id, user_metadata=convert.metadata_from_json(body.get("user_metadata")))

    async def work():
        created = await gw.scheduler.verb("CreateTrainingRun", create, key)
        return Result(json=lambda: {"type": "load_weights", "path": path, "model_id": created.training_run_id})

    return gw.submit(key, f"{session}:load_model:{model_seq_id}", work)


# ---- futures -------------------------------------------------------------------------------------

@router.post("/retrieve_future")
async def retrieve_future(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    request_id = str(body.get("request_id", ""))
    entry = await gw.futures.wait(key, request_id, gw.long_poll_seconds)
    if entry is None:
        # 410: the SDK resubmits a sample; a training verb raises. Seen after a gateway restart.
        return JSONResponse({"error": f"future {request_id!r} is unknown or expired"}, status_code=410)
    if not entry.task.done():
        return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    result: Result = entry.task.result()
    if result.proto is not None and convert.PROTO in request.headers.get("accept", ""):
        return Response(result.proto(), media_type=convert.PROTO)
    return result.json()
