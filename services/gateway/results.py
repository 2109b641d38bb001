"""How each sequenced verb's answer renders for the SDK, and the futures a restarted gateway no longer
holds, answered from the scheduler's record of the request.

A sequenced verb's future id is ``<run>:<seq>`` (routes_training.py), and the scheduler keeps each
run's recent answers by (run, seq) (``GetRequestResult``). So when the gateway restarts while the SDK
waits on such a future, the answer is read back instead of lost; only futures of other calls
(sampling, run creation) and requests the gateway never passed on are gone (410, as before).
"""

from __future__ import annotations

import grpc

from temper.services.gateway import convert
from temper.services.gateway.app import Gateway, Result
from temper.services.gateway.errors import GatewayError, failed_result
from temper.v1 import service_pb2, types_pb2

EPHEMERAL_PREFIX = "ephemeral-"  # the name of an unlisted sampler snapshot (save_weights_for_sampler without a path)
INFLIGHT_PREFIX = "inflight-"    # the name of an in-flight version (save_weights_for_sampler kind="inflight")


def forward_backward_result(out) -> Result:
    return Result(json=lambda: convert.forward_backward_to_json(out), proto=lambda: convert.forward_backward_to_wire(out))


def optim_step_result(resp) -> Result:
    return Result(json=lambda: {"type": "optim_step", "metrics": {convert.metric_key(k): v for k, v in resp.metrics.items()}})


def save_weights_result(resp) -> Result:
    if resp.checkpoint.kind == types_pb2.CHECKPOINT_KIND_EXTERNAL:
        return Result(json=lambda: {"type": "save_weights_external", "path": resp.checkpoint.path,
                                    "size_bytes": resp.checkpoint.size_bytes})
    return Result(json=lambda: {"type": "save_weights", "path": resp.checkpoint.path})


def load_weights_result(resp, run: str, path: str = "") -> Result:
    return Result(json=lambda: {"type": "load_weights", "path": resp.path or path, "model_id": run})


def sequenced_id(run: str, seq: int) -> str:
    return f"{run}:{seq}"


def parse_sequenced_id(request_id: str) -> tuple[str, int] | None:
    """``<session>:train:<n>:<seq>`` -> (run, seq); None for any other future id."""
    run, sep, seq = request_id.rpartition(":")
    if not sep or ":train:" not in run or not seq.isdigit() or int(seq) < 1:
        return None
    return run, int(seq)


async def recovered(gw: Gateway, key: str, request_id: str) -> Result | dict | None:
    """The answer of a sequenced verb this gateway does not hold (it restarted): a Result, a failed
    result, ``{}`` while the scheduler still runs it, or None when it has no such request."""
    parsed = parse_sequenced_id(request_id)
    if parsed is None:
        return None
    run, seq = parsed
    try:
        record = await gw.scheduler.call("GetRequestResult", service_pb2.GetRequestResultRequest(training_run_id=run, seq_id=seq), key)
    except GatewayError as exc:
        if exc.code == grpc.StatusCode.NOT_FOUND:
            return None
        if exc.code == grpc.StatusCode.FAILED_PRECONDITION:  # it failed, or its answer is no longer held
            return failed_result(exc)
        raise
    if not record.done:
        return {}
    answer = record.WhichOneof("answer")
    if answer == "forward_backward":
        return forward_backward_result(record.forward_backward)
    if answer == "optim_step":
        return optim_step_result(record.optim_step)
    if answer == "load_weights":
        return load_weights_result(record.load_weights, run)
    checkpoint = record.save_weights.checkpoint
    if checkpoint.kind != types_pb2.CHECKPOINT_KIND_SAMPLER:
        return save_weights_result(record.save_weights)
    name = checkpoint.checkpoint_id.split("/", 1)[-1]
    if not name.startswith((EPHEMERAL_PREFIX, INFLIGHT_PREFIX)):
        return Result(json=lambda: {"type": "save_weights_for_sampler", "path": checkpoint.path})
    client = client_on(checkpoint, convert.session_of(run), inflight=record.save_weights.weights.version > 0)
    sampler = await gw.scheduler.call("CreateSamplingClient", client, key)
    return Result(json=lambda: {"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id})


def client_on(checkpoint: types_pb2.Checkpoint, session: str, inflight: bool) -> service_pb2.CreateSamplingClientRequest:
    """The sampling client an unnamed sampler save answers with: on the snapshot, or (in-flight) on the
    run's target, which is this save's version or a newer one."""
    if inflight:
        return service_pb2.CreateSamplingClientRequest(session_id=session, inflight_training_run_id=checkpoint.training_run_id)
    return service_pb2.CreateSamplingClientRequest(session_id=session, model_path=checkpoint.path)
