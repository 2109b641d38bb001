"""Tinker SDK wire shapes <-> Temper's public gRPC messages. Pure functions: no network, no state.

Requests arrive as JSON (``model_dump(exclude_none=True, mode="json")`` of the SDK's types) or, for
forward_backward, as the protobuf of tinker_wire.proto (image chunks either way: image_parts.py);
results leave as JSON, or as protobuf for ForwardBackwardOutput and SampleResponse when the SDK asks
for it (it must, from 0.25). Shapes: shared/docs/tinker-wire-spec.md sections 2 and 4.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

import numpy as np
from google.protobuf.message import DecodeError

from temper.client import convert as client_convert
from temper.client import types as t
from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_tokens
from temper.common.strings import shown
from temper.common.validation import TOPK_MASK_LOGPROB
from temper.services.gateway import fields, image_parts
from temper.services.gateway import tinker_wire_pb2 as wire
from temper.services.gateway.errors import invalid
from temper.services.gateway.tensors import Budget, frombuffer, tensor_from_json, tensor_from_wire
from temper.v1 import service_pb2, types_pb2

PROTO = "application/x-protobuf"
_STOP_TO_WIRE = {types_pb2.STOP_REASON_STOP: wire.STOP_REASON_STOP, types_pb2.STOP_REASON_LENGTH: wire.STOP_REASON_LENGTH}
_STOP_TO_JSON = {types_pb2.STOP_REASON_STOP: "stop", types_pb2.STOP_REASON_LENGTH: "length"}
_KIND_TO_JSON = {types_pb2.CHECKPOINT_KIND_TRAINING: "training", types_pb2.CHECKPOINT_KIND_SAMPLER: "sampler",
                 types_pb2.CHECKPOINT_KIND_EXTERNAL: "external"}


# ---- ids -----------------------------------------------------------------------------------------

def session_of(model_id: str) -> str:
    """``<session>:train:<n>`` -> ``<session>``."""
    session, sep, _ = model_id.rpartition(":train:")
    if not sep or not session:
        raise invalid(f"model_id {shown(model_id)} is not of the form <session>:train:<n>")
    return session


def run_id(session_id: str, model_seq_id: int) -> str:
    """The id the SDK expects for its ``model_seq_id``-th training client of a session."""
    return f"{session_id}:train:{model_seq_id}"


def tinker_path(training_run_id: str, checkpoint_id: str) -> str:
    return f"tinker://{training_run_id}/{checkpoint_id}"


def metadata_from_json(body: Mapping[str, Any]) -> dict[str, str]:
    """The ``user_metadata`` field of ``body`` (an object, or absent) as string pairs."""
    return fields.string_map(body, "user_metadata")


# ---- data in -----------------------------------------------------------------------------------

def model_input_from_json(obj: Any, label: str = "model_input") -> types_pb2.ModelInput:
    if not isinstance(obj, Mapping):
        raise invalid(f"{label} must be an object")
    chunks = []
    for i, chunk in enumerate(fields.array(obj, "chunks", default=[], where=f"{label}.")):
        where = f"{label}.chunks[{i}]"
        if not isinstance(chunk, Mapping):
            raise invalid(f"{where} must be an object")
        kind = fields.string(chunk, "type", default="encoded_text", where=f"{where}.")
        if kind != "encoded_text":  # images (base64) and pointers; audio refused (image_parts.py)
            chunks.append(image_parts.chunk_from_json(chunk, kind, where))
            continue
        tokens = fields.integers(fields.array(chunk, "tokens", default=[], where=f"{where}."), f"{where}.tokens", *fields.INT32)
        chunks.append(types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens))))
    return types_pb2.ModelInput(chunks=chunks)


def _model_input_from_wire(chunks, label: str) -> types_pb2.ModelInput:
    out = []
    for i, chunk in enumerate(chunks):
        if chunk.WhichOneof("chunk") != "encoded_text":
            out.append(image_parts.chunk_from_wire(chunk, f"{label}.model_input[{i}]"))
            continue
        frombuffer(chunk.encoded_text.tokens, np.int32)  # whole int32 values
        out.append(types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=chunk.encoded_text.tokens)))
    return types_pb2.ModelInput(chunks=out)


def datum_from_json(obj: Any, budget: Budget, label: str) -> types_pb2.Datum:
    if not isinstance(obj, Mapping):
        raise invalid(f"{label} must be a Datum object")
    inputs = fields.obj(obj, "loss_fn_inputs", {}, where=f"{label}.")
    return types_pb2.Datum(model_input=model_input_from_json(fields.obj(obj, "model_input", {}, where=f"{label}."),
                                                             f"{label}.model_input"),
                           loss_fn_inputs={k: tensor_from_json(v, budget, f"{label}.loss_fn_inputs[{shown(k, 32)}]")
                                           for k, v in inputs.items()})


def datum_from_wire(msg: wire.Datum, budget: Budget, label: str = "datum") -> types_pb2.Datum:
    # Provenance spans serve only stable_reinforce, which Temper does not have yet: ignored.
    return types_pb2.Datum(model_input=_model_input_from_wire(msg.model_input, label),
                           loss_fn_inputs={k: tensor_from_wire(v, budget) for k, v in msg.loss_fn_inputs.items()})


def loss_config(values: Mapping[str, Any] | None) -> dict[str, types_pb2.LossConfigValue]:
    """``loss_fn_config``: numbers (finite) or strings."""
    for key, value in (values or {}).items():
        if not isinstance(value, str) and fields.finite(value) is None:
            raise invalid(f"loss_fn_config[{shown(key, 32)}] must be a finite number or a string")
    return client_convert.loss_config_to_proto(values)


def parse_forward_backward(body: bytes) -> wire.ForwardBackwardRequest:
    msg = wire.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise invalid(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from None
    return msg


def forward_backward_from_wire(msg: wire.ForwardBackwardRequest) -> service_pb2.ForwardBackwardRequest:
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():  # v2 carries strings too and wins
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    budget = Budget()
    return service_pb2.ForwardBackwardRequest(
        training_run_id=msg.model_id, seq_id=msg.seq_id, data=[datum_from_wire(d, budget, f"data[{i}]") for i, d in enumerate(msg.data)],
        loss_fn=msg.loss_fn, loss_fn_config=loss_config(config), forward_only=msg.forward_only)


def forward_backward_from_json(body: Mapping[str, Any], forward_only: bool) -> service_pb2.ForwardBackwardRequest:
    """JSON bodies of SDKs before 0.22.3 (``forward_backward_input``) and of ``/forward`` (``forward_input``)."""
    name = "forward_input" if forward_only and body.get("forward_input") is not None else "forward_backward_input"
    fb, budget = fields.obj(body, name, {}), Budget()
    data = fields.array(fb, "data", default=[], where=f"{name}.")
    return service_pb2.ForwardBackwardRequest(
        training_run_id=fields.string(body, "model_id", default=""), seq_id=fields.integer(body, "seq_id", 0, default=0),
        data=[datum_from_json(d, budget, f"{name}.data[{i}]") for i, d in enumerate(data)],
        loss_fn=fields.string(fb, "loss_fn", default="", where=f"{name}."),
        loss_fn_config=loss_config(fields.obj(fb, "loss_fn_config", None, where=f"{name}.")), forward_only=forward_only)


_ADAM = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def adam_from_json(body: Mapping[str, Any]) -> types_pb2.AdamParams:
    name = "adam_params" if body.get("adam_params") is not None else "optim_params"
    params = fields.obj(body, name, None)
    if params is None:
        other = fields.string(fields.obj(body, "optimizer_params", {}), "type", default="unknown", where="optimizer_params.")
        raise invalid(f"optimizer {shown(other)} is not supported by Temper (AdamW only)")
    defaults = t.AdamParams()
    return client_convert.adam_to_proto(t.AdamParams(**{
        k: fields.number(params, k, default=getattr(defaults, k), where=f"{name}.") for k in _ADAM}))


def lora_from_json(obj: Mapping[str, Any]) -> types_pb2.LoraConfig:
    where = "lora_config."
    return client_convert.lora_to_proto(t.LoraConfig(
        rank=fields.integer(obj, "rank", *fields.INT32, default=32, where=where),
        seed=fields.integer(obj, "seed", default=None, where=where),
        train_attn=fields.boolean(obj, "train_attn", True, where), train_mlp=fields.boolean(obj, "train_mlp", True, where),
        train_unembed=fields.boolean(obj, "train_unembed", True, where)))


def check_optimizer_config(obj: Mapping[str, Any] | None) -> None:
    kind = fields.string(obj or {}, "type", default="adamw", where="optimizer_config.")
    if kind != "adamw":
        raise invalid(f"optimizer {shown(kind)} is not supported by Temper (AdamW only)")


def _stop(params: Mapping[str, Any]) -> str | list[str] | list[int] | None:
    """None (the model's EOS), a string, a list of strings or a list of token ids."""
    stop = params.get("stop")
    if stop is None or isinstance(stop, str):
        return fields.string(params, "stop", fields.MAX_TEXT_CHARS, default=None, where="sampling_params.")
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return fields.strings(params, "stop", where="sampling_params.")
    return fields.integers(stop, "sampling_params.stop (strings or token ids)", *fields.INT32)


def sampling_params_from_json(obj: Mapping[str, Any]) -> types_pb2.SamplingParams:
    """Same semantics as temper.client (stop None: the model's EOS; [] : no stop; top_k -1: off)."""
    where, f32 = "sampling_params.", fields.FLOAT32_MAX
    return client_convert.sampling_params_to_proto(t.SamplingParams(
        max_tokens=fields.integer(obj, "max_tokens", *fields.INT32, default=None, where=where),
        seed=fields.integer(obj, "seed", default=None, where=where), stop=_stop(obj),
        temperature=fields.number(obj, "temperature", -f32, f32, 1.0, where),
        top_k=fields.integer(obj, "top_k", *fields.INT32, default=-1, where=where),
        top_p=fields.number(obj, "top_p", -f32, f32, 1.0, where)))


# ---- results out ---------------------------------------------------------------------------------

def metric_key(key: str) -> str:
    return key if ":" in key else f"{key}:mean"  # the SDK splits every key at ":" to reduce it


def forward_backward_to_wire(out: types_pb2.ForwardBackwardOutput) -> bytes:
    """One ArrayRecord per run of datums whose fields share dtype and trailing shape (usually one)."""
    msg = wire.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord",
                                     metrics={metric_key(k): v for k, v in out.metrics.items()})
    groups: list[tuple[tuple, list[dict[str, np.ndarray]]]] = []
    for item in out.loss_fn_outputs:
        arrays = {name: decode_array(tensor) for name, tensor in item.fields.items()}
        signature = tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in arrays.items()))
        if not groups or groups[-1][0] != signature:
            groups.append((signature, []))
        groups[-1][1].append(arrays)
    for _, datums in groups:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(datums))
        for name in datums[0]:
            parts = [_wire_array(d[name]) for d in datums]
            offsets = np.cumsum([0] + [p.nbytes for p in parts]).astype("<i8")
            record.fields[name].CopyFrom(wire.BatchedTensor(
                data=b"".join(p.tobytes() for p in parts), offsets=offsets.tobytes(),
                dtype=wire.DTYPE_FLOAT32 if parts[0].dtype.kind == "f" else wire.DTYPE_INT64,
                trailing_shape=list(datums[0][name].shape[1:])))
    return msg.SerializeToString()


def _wire_array(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr, dtype="<f4" if arr.dtype.kind == "f" else "<i8")


def _json_tensor(arr: np.ndarray) -> dict:
    float_ = arr.dtype.kind == "f"
    return {"data": arr.astype(np.float32 if float_ else np.int64).reshape(-1).tolist(),
            "dtype": "float32" if float_ else "int64", "shape": list(arr.shape)}


def forward_backward_to_json(out: types_pb2.ForwardBackwardOutput) -> dict:
    return {"loss_fn_output_type": out.loss_fn_output_type or "ArrayRecord",
            "loss_fn_outputs": [{k: _json_tensor(decode_array(v)) for k, v in o.fields.items()} for o in out.loss_fn_outputs],
            "metrics": {metric_key(k): v for k, v in out.metrics.items()}}


def _prompt_logprobs(resp: types_pb2.SampleResponse) -> np.ndarray | None:
    """NaN where not scored (position 0, before prompt_logprobs_last_n)."""
    return decode_array(resp.prompt_logprobs).astype(np.float32).reshape(-1) if resp.HasField("prompt_logprobs") else None


def _topk_prompt(resp: types_pb2.SampleResponse) -> tuple[np.ndarray, np.ndarray] | None:
    """(len(prompt), k) ids and logprobs; unscored rows hold Tinker's sentinel (0, -99999)."""
    if not resp.HasField("topk_prompt_token_ids"):
        return None
    return decode_array(resp.topk_prompt_token_ids).astype("<i4"), decode_array(resp.topk_prompt_logprobs).astype("<f4")


def sample_to_wire(resp: types_pb2.SampleResponse) -> bytes:
    msg = wire.SampleResponse(prompt_cache_hit_tokens=resp.prompt_cache_hit_tokens)
    for s in resp.sequences:
        seq = msg.sequences.add(stop_reason=_STOP_TO_WIRE.get(s.stop_reason, wire.STOP_REASON_LENGTH), tokens=s.tokens,
                                logprobs=s.logprobs)  # always sent: RL needs them, and empty would read as None
        if s.topk:
            seq.topk_sampled_logprobs.CopyFrom(wire.TopkLogprobs(token_ids=s.topk_token_ids, logprobs=s.topk_logprobs, k=s.topk,
                                                                 length=len(s.tokens) // 4))
    prompt = _prompt_logprobs(resp)
    if prompt is not None:
        msg.prompt_logprobs = prompt.astype("<f4").tobytes()
    top = _topk_prompt(resp)
    if top is not None:
        ids, lps = top
        msg.topk_prompt_logprobs.CopyFrom(wire.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=ids.shape[1],
                                                            length=ids.shape[0]))
    return msg.SerializeToString()


def sample_to_json(resp: types_pb2.SampleResponse) -> dict:
    """For SDKs before 0.25 (JSON results)."""
    sequences = []
    for s in resp.sequences:
        item = {"stop_reason": _STOP_TO_JSON.get(s.stop_reason, "length"), "tokens": decode_tokens(s.tokens).tolist(),
                "logprobs": decode_floats(s.logprobs).tolist(), "sequence_id": s.sequence_id,
                "weights_versions": spans_to_json(s.versions)}  # Temper's: the weights of each token (docs/async_rl.md)
        if s.topk:
            ids = decode_tokens(s.topk_token_ids).reshape(-1, s.topk)
            lps = decode_floats(s.topk_logprobs).reshape(-1, s.topk)
            item["topk_logprobs"] = [list(zip(r_ids.tolist(), r_lps.tolist())) for r_ids, r_lps in zip(ids, lps)]
        sequences.append(item)
    prompt = _prompt_logprobs(resp)
    body: dict[str, Any] = {"sequences": sequences, "type": "sample",
                            "prompt_cache_hit_tokens": resp.prompt_cache_hit_tokens}
    if prompt is not None:
        body["prompt_logprobs"] = [None if np.isnan(x) else float(x) for x in prompt]
    top = _topk_prompt(resp)
    if top is not None:
        body["topk_prompt_logprobs"] = [None if r_lps[0] == TOPK_MASK_LOGPROB else list(zip(r_ids.tolist(), r_lps.tolist()))
                                        for r_ids, r_lps in zip(*top)]
    return body


def spans_to_json(spans) -> list[dict]:
    return [{"path": v.weights.path, "version": v.weights.version, "first_token": v.first_token, "count": v.count} for v in spans]


def _iso(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc).isoformat()


def checkpoint_to_json(c: types_pb2.Checkpoint) -> dict:
    body = {"checkpoint_id": c.checkpoint_id, "checkpoint_type": _KIND_TO_JSON.get(c.kind, "sampler"),
            "time": _iso(c.created_unix_ms), "tinker_path": c.path, "size_bytes": c.size_bytes, "public": c.published}
    if c.expires_unix_ms:
        body["expires_at"] = _iso(c.expires_unix_ms)
    if c.user_metadata:
        body["user_metadata"] = dict(c.user_metadata)
    if c.base_model:
        body["base_model"] = c.base_model  # the SDK's Checkpoint.base_model (0.39)
    return body


def model_shape(info: service_pb2.TrainingRunInfo) -> dict:
    """The model family and, for a mixture-of-experts model, its routed experts and the adapter's rank
    per expert (the SDK keeps ModelData.arch; the other fields are Temper's, read from the JSON)."""
    shape = {"arch": info.family} if info.family else {}
    if info.num_experts:
        shape.update(num_experts=info.num_experts, num_experts_per_tok=info.num_experts_per_tok,
                     expert_rank=info.lora_config.expert_rank)
    return shape


def info_to_json(info: service_pb2.TrainingRunInfo) -> dict:
    return {"type": "get_info", "model_id": info.training_run_id, "model_name": info.base_model, "is_lora": True,
            "lora_rank": info.lora_config.rank, "optimizer_config": {"type": "adamw"},
            "model_data": {"model_name": info.base_model, "tokenizer_id": info.tokenizer_id, **model_shape(info)}}


def weights_info_to_json(checkpoint: types_pb2.Checkpoint) -> dict:
    """From GetCheckpoint: also for another tenant's published checkpoint."""
    lora = checkpoint.lora_config
    return {"base_model": checkpoint.base_model, "optimizer_config": {"type": "adamw"}, "is_lora": True, "lora_rank": lora.rank,
            "train_unembed": lora.train_unembed, "train_mlp": lora.train_mlp, "train_attn": lora.train_attn}


def training_run_to_json(info: service_pb2.TrainingRunInfo, checkpoints: list[types_pb2.Checkpoint]) -> dict:
    """``checkpoints``: the run's (the newest of each kind is shown)."""
    def newest(kind):
        of_kind = [c for c in checkpoints if c.kind == kind]
        return max(of_kind, key=lambda c: c.created_unix_ms) if of_kind else None

    training, sampler = newest(types_pb2.CHECKPOINT_KIND_TRAINING), newest(types_pb2.CHECKPOINT_KIND_SAMPLER)
    latest = max([info.last_request_unix_ms, info.created_unix_ms, *(c.created_unix_ms for c in checkpoints)])
    return {"training_run_id": info.training_run_id, "base_model": info.base_model, "model_owner": info.owner, "is_lora": True,
            "corrupted": False, "lora_rank": info.lora_config.rank,
            "last_request_time": _iso(latest) if latest else datetime.now(timezone.utc).isoformat(),
            "last_checkpoint": checkpoint_to_json(training) if training else None,
            "last_sampler_checkpoint": checkpoint_to_json(sampler) if sampler else None,
            "user_metadata": dict(info.user_metadata) or None,
            **{("model_family" if k == "arch" else k): v for k, v in model_shape(info).items()}}


def capabilities_to_json(resp: service_pb2.GetServerCapabilitiesResponse) -> dict:
    """family, num_experts, num_experts_per_tok: Temper's; the SDK's SupportedModel ignores fields it does not
    know (its response models are extra="ignore"), so they are there for other HTTP clients."""
    return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                  "trainable": m.trainable, "sampleable": m.sampleable, "family": m.family,
                                  "num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok}
                                 for m in resp.supported_models]}
