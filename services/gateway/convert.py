"""Tinker SDK wire shapes <-> Temper's public gRPC messages. Pure functions: no network, no state.

Requests arrive as JSON (``model_dump(exclude_none=True, mode="json")`` of the SDK's types) or, for
forward_backward, as the protobuf of tinker_wire.proto; results leave as JSON, or as protobuf for
ForwardBackwardOutput and SampleResponse when the SDK asks for it (it must, from 0.25). Shapes:
shared/docs/tinker-wire-spec.md sections 2 and 4.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

import numpy as np
from google.protobuf.message import DecodeError

from temper.client import convert as client_convert
from temper.client import types as t
from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_array, encode_tokens
from temper.common.validation import TOPK_MASK_LOGPROB
from temper.services.gateway import tinker_wire_pb2 as wire
from temper.services.gateway.errors import invalid
from temper.v1 import service_pb2, types_pb2

PROTO = "application/x-protobuf"
_WIRE_DTYPES = {wire.DTYPE_FLOAT32: np.float32, wire.DTYPE_INT64: np.int64, wire.DTYPE_INT32: np.int32}
_JSON_DTYPES = {"float32": np.float32, "int64": np.int64}
_STOP_TO_WIRE = {types_pb2.STOP_REASON_STOP: wire.STOP_REASON_STOP, types_pb2.STOP_REASON_LENGTH: wire.STOP_REASON_LENGTH}
_STOP_TO_JSON = {types_pb2.STOP_REASON_STOP: "stop", types_pb2.STOP_REASON_LENGTH: "length"}
_KIND_TO_JSON = {types_pb2.CHECKPOINT_KIND_TRAINING: "training", types_pb2.CHECKPOINT_KIND_SAMPLER: "sampler"}


# ---- ids -----------------------------------------------------------------------------------------

def session_of(model_id: str) -> str:
    """``<session>:train:<n>`` -> ``<session>``."""
    session, sep, _ = model_id.rpartition(":train:")
    if not sep or not session:
        raise invalid(f"model_id {model_id!r} is not of the form <session>:train:<n>")
    return session


def run_id(session_id: str, model_seq_id: int) -> str:
    """The id the SDK expects for its ``model_seq_id``-th training client of a session."""
    return f"{session_id}:train:{model_seq_id}"


def tinker_path(training_run_id: str, checkpoint_id: str) -> str:
    return f"tinker://{training_run_id}/{checkpoint_id}"


def metadata_from_json(obj: Any) -> dict[str, str]:
    """A ``user_metadata`` body field (a JSON object, or absent) as string pairs."""
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise invalid("user_metadata must be an object of strings")
    return {str(k): str(v) for k, v in obj.items()}


# ---- tensors and data in -------------------------------------------------------------------------

def _csr_to_dense(values: np.ndarray, crow: np.ndarray, col: np.ndarray, shape: list[int]) -> np.ndarray:
    """A 2-D CSR tensor (the SDK sends 2-D target_tokens / weights this way) as a dense one, pad 0."""
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
        raise invalid(f"sparse tensor of shape {shape}: {len(crow)} row pointers, {len(col)} columns, {len(values)} values")
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    if len(rows) != len(values) or (len(col) and (col.min() < 0 or col.max() >= shape[1])):
        raise invalid("sparse tensor indices out of range")
    dense = np.zeros(shape, dtype=values.dtype)
    dense[rows, col] = values
    return dense


def _shaped(arr: np.ndarray, shape: list[int] | None) -> np.ndarray:
    if not shape:
        return arr
    if int(np.prod(shape)) != arr.size:
        raise invalid(f"tensor of {arr.size} values does not fit shape {shape}")
    return arr.reshape(shape)


def tensor_from_json(obj: Mapping[str, Any]) -> types_pb2.Tensor:
    dtype = _JSON_DTYPES.get(obj.get("dtype"))
    if dtype is None:
        raise invalid(f"tensor dtype must be float32 or int64, got {obj.get('dtype')!r}")
    values = np.asarray(obj.get("data", []), dtype=dtype).reshape(-1)
    if obj.get("sparse_crow_indices") is not None:
        arr = _csr_to_dense(values, np.asarray(obj["sparse_crow_indices"], np.int64),
                            np.asarray(obj.get("sparse_col_indices") or [], np.int64), list(obj.get("shape") or []))
    else:
        arr = _shaped(values, obj.get("shape"))
    return encode_array(arr, obj["dtype"])


def tensor_from_wire(msg: wire.Tensor) -> types_pb2.Tensor:
    dtype = _WIRE_DTYPES.get(msg.dtype)
    if dtype is None:
        raise invalid(f"tensor dtype {wire.DType.Name(msg.dtype) if msg.dtype in wire.DType.values() else msg.dtype} is not supported")
    name = "float32" if dtype is np.float32 else "int64"
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        arr = _csr_to_dense(_frombuffer(csr.values, dtype), _frombuffer(csr.crow_indices, np.int64),
                            _frombuffer(csr.col_indices, np.int64), list(msg.shape))
    else:
        arr = _shaped(_frombuffer(msg.dense, dtype), list(msg.shape))
    return encode_array(arr.astype(np.float32 if name == "float32" else np.int64), name)


def _frombuffer(data: bytes, dtype) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise invalid(f"{len(data)} bytes are not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))


def model_input_from_json(obj: Mapping[str, Any]) -> types_pb2.ModelInput:
    chunks = []
    for chunk in obj.get("chunks", []):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise invalid(f"{kind} chunks are not supported by Temper (text tokens only)")
        chunks.append(types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(chunk.get("tokens", [])))))
    return types_pb2.ModelInput(chunks=chunks)


def _model_input_from_wire(chunks) -> types_pb2.ModelInput:
    out = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise invalid(f"{kind} chunks are not supported by Temper (text tokens only)")
        _frombuffer(chunk.encoded_text.tokens, np.int32)  # whole int32 values
        out.append(types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=chunk.encoded_text.tokens)))
    return types_pb2.ModelInput(chunks=out)


def datum_from_json(obj: Mapping[str, Any]) -> types_pb2.Datum:
    return types_pb2.Datum(model_input=model_input_from_json(obj.get("model_input", {})),
                           loss_fn_inputs={k: tensor_from_json(v) for k, v in obj.get("loss_fn_inputs", {}).items()})


def datum_from_wire(msg: wire.Datum) -> types_pb2.Datum:
    # Provenance spans serve only stable_reinforce, which Temper does not have yet: ignored.
    return types_pb2.Datum(model_input=_model_input_from_wire(msg.model_input),
                           loss_fn_inputs={k: tensor_from_wire(v) for k, v in msg.loss_fn_inputs.items()})


def loss_config(values: Mapping[str, float | str] | None) -> dict[str, types_pb2.LossConfigValue]:
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
    return service_pb2.ForwardBackwardRequest(
        training_run_id=msg.model_id, seq_id=msg.seq_id, data=[datum_from_wire(d) for d in msg.data], loss_fn=msg.loss_fn,
        loss_fn_config=loss_config(config), forward_only=msg.forward_only)


def forward_backward_from_json(body: Mapping[str, Any], forward_only: bool) -> service_pb2.ForwardBackwardRequest:
    """JSON bodies of SDKs before 0.22.3 (``forward_backward_input``) and of ``/forward`` (``forward_input``)."""
    fb = body.get("forward_input" if forward_only else "forward_backward_input") or body.get("forward_backward_input") or {}
    return service_pb2.ForwardBackwardRequest(
        training_run_id=body.get("model_id", ""), seq_id=int(body.get("seq_id") or 0),
        data=[datum_from_json(d) for d in fb.get("data", [])], loss_fn=fb.get("loss_fn", ""),
        loss_fn_config=loss_config(fb.get("loss_fn_config")), forward_only=forward_only)


def adam_from_json(body: Mapping[str, Any]) -> types_pb2.AdamParams:
    params = body.get("adam_params") or body.get("optim_params")
    if params is None:
        other = (body.get("optimizer_params") or {}).get("type", "unknown")
        raise invalid(f"optimizer {other!r} is not supported by Temper (AdamW only)")
    defaults = t.AdamParams()
    return client_convert.adam_to_proto(t.AdamParams(**{k: float(params.get(k, getattr(defaults, k))) for k in (
        "learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}))


def lora_from_json(obj: Mapping[str, Any]) -> types_pb2.LoraConfig:
    return client_convert.lora_to_proto(t.LoraConfig(
        rank=int(obj.get("rank", 32)), seed=obj.get("seed"), train_attn=bool(obj.get("train_attn", True)),
        train_mlp=bool(obj.get("train_mlp", True)), train_unembed=bool(obj.get("train_unembed", True))))


def check_optimizer_config(obj: Mapping[str, Any] | None) -> None:
    kind = (obj or {}).get("type", "adamw")
    if kind != "adamw":
        raise invalid(f"optimizer {kind!r} is not supported by Temper (AdamW only)")


def sampling_params_from_json(obj: Mapping[str, Any]) -> types_pb2.SamplingParams:
    """Same semantics as temper.client (stop None: the model's EOS; [] : no stop; top_k -1: off)."""
    return client_convert.sampling_params_to_proto(t.SamplingParams(
        max_tokens=obj.get("max_tokens"), seed=obj.get("seed"), stop=obj.get("stop"),
        temperature=float(obj.get("temperature", 1.0)), top_k=int(obj.get("top_k", -1)), top_p=float(obj.get("top_p", 1.0))))


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
    msg = wire.SampleResponse()
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
                "logprobs": decode_floats(s.logprobs).tolist(), "sequence_id": s.sequence_id}
        if s.topk:
            ids = decode_tokens(s.topk_token_ids).reshape(-1, s.topk)
            lps = decode_floats(s.topk_logprobs).reshape(-1, s.topk)
            item["topk_logprobs"] = [list(zip(r_ids.tolist(), r_lps.tolist())) for r_ids, r_lps in zip(ids, lps)]
        sequences.append(item)
    prompt = _prompt_logprobs(resp)
    body: dict[str, Any] = {"sequences": sequences, "type": "sample"}
    if prompt is not None:
        body["prompt_logprobs"] = [None if np.isnan(x) else float(x) for x in prompt]
    top = _topk_prompt(resp)
    if top is not None:
        body["topk_prompt_logprobs"] = [None if r_lps[0] == TOPK_MASK_LOGPROB else list(zip(r_ids.tolist(), r_lps.tolist()))
                                        for r_ids, r_lps in zip(*top)]
    return body


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


def info_to_json(info: service_pb2.TrainingRunInfo) -> dict:
    return {"type": "get_info", "model_id": info.training_run_id, "model_name": info.base_model, "is_lora": True,
            "lora_rank": info.lora_config.rank, "optimizer_config": {"type": "adamw"},
            "model_data": {"model_name": info.base_model, "tokenizer_id": info.tokenizer_id}}


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
            "user_metadata": dict(info.user_metadata) or None}


def capabilities_to_json(resp: service_pb2.GetServerCapabilitiesResponse) -> dict:
    return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                  "trainable": m.trainable, "sampleable": m.sampleable} for m in resp.supported_models]}
