"""Training routes: create_model, get_info, the sequenced verbs, save/load, and retrieve_future.

A sequenced verb keeps the SDK's seq_id (the scheduler runs a run's requests in that order and
answers a resent (run, seq) with its first answer). A route reads the run and the seq first (a body
without them is refused at once); the rest of the request is read in ``build``, inside the future, so
a request refused there, for any reason, still spends its seq at the scheduler (``_spend``) and the
run's later requests do not wait on a gap.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from temper.common.strings import shown
from temper.services.gateway import convert, fields, image_parts, results
from temper.services.gateway.abandon import abandon_unless_settled
from temper.services.gateway.app import Gateway, Result, api_key, fingerprint, gateway, image_limits, json_body
from temper.services.gateway.errors import GatewayError, failed_result, invalid, request_error
from temper.services.models.images import DEFAULT_LIMITS, ImageLimits
from temper.v1 import service_pb2, types_pb2

log = logging.getLogger("temper.gateway")
router = APIRouter(prefix="/api/v1")


async def _spend(gw: Gateway, key: str, run: str, seq: int, error: GatewayError) -> None:
    """Send an empty forward_backward under ``seq`` (refused at once, which spends it), then fail with ``error``."""
    empty = service_pb2.ForwardBackwardRequest(training_run_id=run, seq_id=seq, loss_fn="cross_entropy")
    try:
        await gw.scheduler.verb("ForwardBackward", empty, key)
    except GatewayError as refused:
        abandon_unless_settled(gw.scheduler, key, run, seq, refused)
    raise error


async def _build(gw: Gateway, key: str, run: str, seq: int, build, limits: ImageLimits = DEFAULT_LIMITS):
    """``build(seq)``, the request, its images checked (in a thread); whatever it raises is the caller's
    request refused (INVALID_ARGUMENT unless it carries a code of its own), and the seq is spent."""
    try:
        out = build(seq)
        if any(c.HasField("image") for d in getattr(out, "data", ()) for c in d.model_input.chunks):
            await asyncio.to_thread(image_parts.check_images, [d.model_input for d in out.data], limits, "datum")
        return out
    except Exception as exc:  # noqa: BLE001 - any failure to read the request spends its seq
        error = request_error(exc)
        if error.code == grpc.StatusCode.INTERNAL:  # a request it takes too much to read is refused all the same
            error = invalid(f"the request could not be read ({type(exc).__name__})")
        await _spend(gw, key, run, seq, error)


def _run_and_seq(body: dict) -> tuple[str, int]:
    return fields.string(body, "model_id"), fields.integer(body, "seq_id", 0, default=0)


async def _sequenced(request: Request, run: str, seq: int, build, method: str, render) -> dict:
    """Submit one sequenced verb: ``build(seq)`` makes the request, ``render(response)`` the Result."""
    gw, key, limits = gateway(request), api_key(request), image_limits(request)

    async def work():
        request = await _build(gw, key, run, seq, build, limits)
        try:
            response = await gw.scheduler.verb(method, request, key)
        except BaseException as exc:
            abandon_unless_settled(gw.scheduler, key, run, seq, exc)
            raise
        return render(response)

    return gw.submit(key, results.sequenced_id(run, seq), work, await fingerprint(request))


# ---- runs ----------------------------------------------------------------------------------------

@router.post("/create_model")
async def create_model(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    convert.check_optimizer_config(fields.obj(body, "optimizer_config", None))
    session, model_seq_id = fields.string(body, "session_id"), fields.integer(body, "model_seq_id", 0, default=None)
    create = service_pb2.CreateTrainingRunRequest(
        session_id=session, base_model=fields.string(body, "base_model"),
        lora_config=convert.lora_from_json(fields.obj(body, "lora_config", {})), user_metadata=convert.metadata_from_json(body))
    if model_seq_id is not None:
        create.run_index = model_seq_id  # the run id the SDK computes: <session>:train:<model_seq_id>

    async def work():
        info = await gw.scheduler.verb("CreateTrainingRun", create, key)
        return Result(json=lambda: {"type": "create_model", "model_id": info.training_run_id})

    return gw.submit(key, f"{session}:create_model:{model_seq_id or 0}", work, await fingerprint(request))


@router.post("/get_info")
async def get_info(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    info = await gw.scheduler.call("GetInfo", service_pb2.GetInfoRequest(training_run_id=fields.string(body, "model_id")), key)
    return convert.info_to_json(info)


# ---- forward / backward / optim ------------------------------------------------------------------

@router.post("/forward_backward")
async def forward_backward(request: Request):
    """Protobuf (SDK >= 0.22.3) or JSON (older SDKs) body."""
    api_key(request)
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise invalid("compressed forward_backward bodies are not accepted (client config proto_compress_fwdbwd is off)")
    if "protobuf" in request.headers.get("content-type", ""):
        msg = convert.parse_forward_backward(await request.body())
        run, seq = fields.text(msg.model_id, "model_id"), msg.seq_id
        if seq < 0:
            raise invalid("seq_id must be >= 0")

        def build(seq):
            out = convert.forward_backward_from_wire(msg)
            out.training_run_id, out.seq_id = run, seq
            return out
    else:
        body = await json_body(request)
        run, seq = _run_and_seq(body)

        def build(seq):
            out = convert.forward_backward_from_json(body, forward_only=False)
            out.seq_id = seq
            return out
    return await _sequenced(request, run, seq, build, "ForwardBackward", results.forward_backward_result)


@router.post("/forward")
async def forward(request: Request):
    """SDKs before 0.25 send forward passes here, as JSON."""
    api_key(request)
    body = await json_body(request)
    run, seq = _run_and_seq(body)

    def build(seq):
        out = convert.forward_backward_from_json(body, forward_only=True)
        out.seq_id = seq
        return out

    return await _sequenced(request, run, seq, build, "ForwardBackward", results.forward_backward_result)


@router.post("/optim_step")
async def optim_step(request: Request):
    api_key(request)
    body = await json_body(request)
    run, seq = _run_and_seq(body)

    def build(seq):
        return service_pb2.OptimStepRequest(training_run_id=run, seq_id=seq, adam_params=convert.adam_from_json(body))

    return await _sequenced(request, run, seq, build, "OptimStep", results.optim_step_result)


# ---- checkpoints ---------------------------------------------------------------------------------

def _save_request(body: dict, run: str, seq: int, kind: int, name: str, ephemeral: bool = False) -> service_pb2.SaveWeightsRequest:
    return service_pb2.SaveWeightsRequest(
        training_run_id=run, seq_id=seq, name=name, kind=kind, ttl_seconds=fields.integer(body, "ttl_seconds", default=0),
        ephemeral=ephemeral, overwrite=fields.boolean(body, "overwrite"), user_metadata=convert.metadata_from_json(body))


@router.post("/save_weights")
async def save_weights(request: Request):
    api_key(request)
    body = await json_body(request)
    run, seq = _run_and_seq(body)

    def build(seq):
        return _save_request(body, run, seq, types_pb2.CHECKPOINT_KIND_TRAINING, fields.string(body, "path", default="") or f"state-{seq}")

    return await _sequenced(request, run, seq, build, "SaveWeights", results.save_weights_result)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request):
    """Named (``path``: a listed sampler checkpoint) or ephemeral (``sampling_session_seq_id``: an
    unlisted snapshot, answered with a sampling client on it); ``kind="inflight"``: the run's next
    in-flight version (docs/async_rl.md), answered with an in-flight sampling client."""
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    run, seq = _run_and_seq(body)

    def build(seq):
        kind = fields.string(body, "kind", default="snapshot")
        if kind not in ("snapshot", "inflight"):
            raise invalid(f"sampler kind {shown(kind)} is not supported: snapshot or inflight")
        fields.integer(body, "sampling_session_seq_id", 0, default=None)  # the scheduler names the sampler
        name = fields.string(body, "path", default=None)
        if kind == "inflight":
            if name is not None:
                raise invalid("an inflight save takes no path (its versions are unlisted)")
            save = _save_request(body, run, seq, types_pb2.CHECKPOINT_KIND_SAMPLER, f"{results.INFLIGHT_PREFIX}{seq}", ephemeral=True)
            save.inflight = True
            return save, convert.session_of(run)
        ephemeral = name is None
        save = _save_request(body, run, seq, types_pb2.CHECKPOINT_KIND_SAMPLER, name or f"{results.EPHEMERAL_PREFIX}{seq}-{uuid.uuid4().hex[:8]}",
                             ephemeral=ephemeral)
        return save, (convert.session_of(run) if ephemeral else None)

    async def work():
        save, session = await _build(gw, key, run, seq, build)
        try:
            saved = await gw.scheduler.verb("SaveWeights", save, key)
        except BaseException as exc:
            abandon_unless_settled(gw.scheduler, key, run, seq, exc)
            raise
        if session is None:
            return Result(json=lambda: {"type": "save_weights_for_sampler", "path": saved.checkpoint.path})
        sampler = await gw.scheduler.verb("CreateSamplingClient", results.client_on(saved.checkpoint, session, save.inflight), key)
        return Result(json=lambda: {"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id})

    return gw.submit(key, results.sequenced_id(run, seq), work, await fingerprint(request))


@router.post("/save_weights_external")
async def save_weights_external(request: Request):
    """A peft adapter folder (adapter_config.json + adapter_model.safetensors) as the checkpoint
    tinker://<run>/external_weights/<name>, downloaded through get_external_weights_urls."""
    api_key(request)
    body = await json_body(request)
    run, seq = _run_and_seq(body)

    def build(seq):
        if body.get("age_encryption_recipients"):
            raise invalid("age_encryption_recipients is not supported: Temper saves external weights unencrypted "
                          "(download them over HTTPS and encrypt them yourself)")
        return _save_request(body, run, seq, types_pb2.CHECKPOINT_KIND_EXTERNAL, fields.string(body, "path"))

    return await _sequenced(request, run, seq, build, "SaveWeights", results.save_weights_result)


@router.post("/load_weights")
async def load_weights(request: Request):
    """On a run (``model_id`` + ``seq_id``), or creating one from the checkpoint (``session_id`` +
    ``model_seq_id``: the SDK's create_training_client_from_state[_with_optimizer])."""
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    if fields.string(body, "model_id", default=""):
        run, seq = _run_and_seq(body)

        def build(seq):
            return service_pb2.LoadWeightsRequest(training_run_id=run, seq_id=seq, path=fields.string(body, "path"),
                                                  with_optimizer=fields.boolean(body, "optimizer"))

        return await _sequenced(request, run, seq, build, "LoadWeights",
                                lambda resp: results.load_weights_result(resp, run, body.get("path") or ""))
    session, model_seq_id = fields.string(body, "session_id"), fields.integer(body, "model_seq_id", 0, default=0)
    path = fields.string(body, "path")
    convert.check_optimizer_config(fields.obj(body, "optimizer_config", None))
    # One call: the scheduler takes the LoRA config from the checkpoint (also another tenant's published
    # one) and loads it as part of creation, using no seq, so the SDK's seq 1 is the run's seq 1.
    create = service_pb2.CreateTrainingRunRequest(
        session_id=session, base_model=fields.string(body, "base_model", default=""), from_path=path,
        with_optimizer=fields.boolean(body, "optimizer"), run_index=model_seq_id, user_metadata=convert.metadata_from_json(body))

    async def work():
        created = await gw.scheduler.verb("CreateTrainingRun", create, key)
        return Result(json=lambda: {"type": "load_weights", "path": path, "model_id": created.training_run_id})

    return gw.submit(key, f"{session}:load_model:{model_seq_id}", work, await fingerprint(request))


# ---- futures -------------------------------------------------------------------------------------

MAX_REQUEST_ID_CHARS = 1024  # longer than any id the gateway hands out


@router.post("/retrieve_future")
async def retrieve_future(request: Request):
    gw, key, body = gateway(request), api_key(request), await json_body(request)
    request_id = fields.string(body, "request_id", MAX_REQUEST_ID_CHARS)
    entry = await gw.futures.wait(key, request_id, gw.long_poll_seconds)
    result = entry.task.result() if entry is not None and entry.task.done() else None
    if entry is None:  # this gateway restarted since (or it expired): a sequenced verb's answer is read back
        result = await results.recovered(gw, key, request_id)
        if result is None:  # 410: the SDK resubmits a sample; a training verb raises
            return JSONResponse({"error": f"future {shown(request_id)} is unknown or expired"}, status_code=410)
        if result == {}:  # still running at the scheduler: asked again after a pause, not in a tight loop
            await asyncio.sleep(min(1.0, gw.long_poll_seconds))
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if isinstance(result, dict):
            return result
    if result is None:
        return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    try:
        if result.proto is not None and convert.PROTO in request.headers.get("accept", ""):
            return Response(result.proto(), media_type=convert.PROTO)
        return result.json()
    except Exception as exc:  # noqa: BLE001 - a result that cannot be rendered is a failed verb, never a 4xx
        log.exception("rendering %s failed", shown(request_id))
        return failed_result(GatewayError.of(exc))
