"""Client types <-> protobuf messages (the only place the client touches wire formats)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Mapping

import numpy as np

from temper.client import types as t
from temper.client.versions import spans_from_proto
from temper.common.codec import decode_array, decode_floats, decode_tokens, encode_array, encode_tokens
from temper.common.validation import TOPK_MASK_LOGPROB
from temper.v1 import service_pb2, types_pb2

_STOP = {types_pb2.STOP_REASON_STOP: "stop", types_pb2.STOP_REASON_LENGTH: "length"}


def model_input_to_proto(model_input: t.ModelInput) -> types_pb2.ModelInput:
    return types_pb2.ModelInput(chunks=[chunk_to_proto(c) for c in model_input.chunks])


def chunk_to_proto(chunk: t.ModelInputChunk) -> types_pb2.ModelInputChunk:
    """A text chunk's tokens, an image's bytes or an uploaded image's location (with expected_tokens when known)."""
    if isinstance(chunk, t.EncodedTextChunk):
        return types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(chunk.tokens)))
    if isinstance(chunk, t.ImageChunk):
        return types_pb2.ModelInputChunk(image=types_pb2.ImageChunk(data=bytes(chunk.data), format=chunk.format,
                                                                    expected_tokens=chunk.expected_tokens))
    if isinstance(chunk, t.ImageAssetPointerChunk):
        return types_pb2.ModelInputChunk(image_asset_pointer=types_pb2.ImageAssetPointerChunk(
            location=chunk.location, format=chunk.format, expected_tokens=chunk.expected_tokens))
    raise TypeError(f"a model input chunk is an EncodedTextChunk, ImageChunk or ImageAssetPointerChunk, not {type(chunk).__name__}")


def model_input_from_proto(message: types_pb2.ModelInput) -> t.ModelInput:
    chunks = []
    for chunk in message.chunks:
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            chunks.append(t.EncodedTextChunk(tokens=decode_tokens(chunk.encoded_text.tokens).tolist()))
        elif kind in ("image", "image_asset_pointer"):
            given = getattr(chunk, kind)
            expected = given.expected_tokens if given.HasField("expected_tokens") else None
            chunks.append(t.ImageChunk(data=given.data, format=given.format, expected_tokens=expected) if kind == "image" else
                          t.ImageAssetPointerChunk(location=given.location, format=given.format, expected_tokens=expected))
        else:
            raise ValueError(f"model input chunk {kind!r} has no client type")
    return t.ModelInput(chunks=chunks)


def image_asset_from_proto(message: service_pb2.ImageAsset) -> t.ImageAsset:
    return t.ImageAsset(location=message.location, format=message.format, width=message.width, height=message.height,
                        size_bytes=message.size_bytes, time=datetime.fromtimestamp(message.created_unix_ms / 1000, tz=timezone.utc),
                        created=message.created,
                        expected_tokens=message.expected_tokens if message.HasField("expected_tokens") else None)


def capabilities_from_proto(message: service_pb2.GetServerCapabilitiesResponse) -> t.GetServerCapabilitiesResponse:
    return t.GetServerCapabilitiesResponse([
        t.SupportedModel(m.model_name, m.max_context_length, m.trainable, m.sampleable, m.family, m.num_experts,
                         m.num_experts_per_tok, vision_from_proto(m.vision) if m.HasField("vision") else None)
        for m in message.supported_models])


def vision_from_proto(message: types_pb2.VisionInfo) -> t.VisionInfo:
    return t.VisionInfo(message.image_token_id, message.vision_start_token_id, message.vision_end_token_id,
                        message.image_processor_json)


def tensor_to_proto(tensor: t.TensorData) -> types_pb2.Tensor:
    return encode_array(tensor.to_numpy(), tensor.dtype)


def tensor_from_proto(message: types_pb2.Tensor) -> t.TensorData:
    arr = decode_array(message)
    return t.TensorData(data=arr, dtype=str(arr.dtype), shape=list(arr.shape))


def datum_to_proto(datum: t.Datum) -> types_pb2.Datum:
    return types_pb2.Datum(
        model_input=model_input_to_proto(datum.model_input),
        loss_fn_inputs={k: tensor_to_proto(v) for k, v in datum.loss_fn_inputs.items()},
    )


def loss_config_to_proto(config: Mapping[str, float | str] | None) -> dict[str, types_pb2.LossConfigValue]:
    out = {}
    for key, value in (config or {}).items():
        out[key] = types_pb2.LossConfigValue(text=value) if isinstance(value, str) else types_pb2.LossConfigValue(number=float(value))
    return out


def forward_backward_from_proto(message: types_pb2.ForwardBackwardOutput) -> t.ForwardBackwardOutput:
    return t.ForwardBackwardOutput(
        loss_fn_output_type=message.loss_fn_output_type,
        loss_fn_outputs=[{k: tensor_from_proto(v) for k, v in out.fields.items()} for out in message.loss_fn_outputs],
        metrics=t.metrics_dict(message.metrics),
    )


def adam_to_proto(params: t.AdamParams) -> types_pb2.AdamParams:
    return types_pb2.AdamParams(
        learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2, eps=params.eps,
        weight_decay=params.weight_decay, grad_clip_norm=params.grad_clip_norm,
    )


def lora_to_proto(cfg: t.LoraConfig) -> types_pb2.LoraConfig:
    message = types_pb2.LoraConfig(
        rank=cfg.rank, alpha=cfg.alpha or 0.0, train_attn=cfg.train_attn, train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed, dropout=cfg.dropout, expert_rank=cfg.expert_rank,
    )
    if cfg.seed is not None:
        message.seed = cfg.seed
    return message


def lora_from_proto(message: types_pb2.LoraConfig) -> t.LoraConfig:
    return t.LoraConfig(
        rank=message.rank, alpha=message.alpha, seed=message.seed if message.HasField("seed") else None,
        train_attn=message.train_attn, train_mlp=message.train_mlp, train_unembed=message.train_unembed, dropout=message.dropout,
        expert_rank=message.expert_rank,
    )


def sampling_params_to_proto(params: t.SamplingParams) -> types_pb2.SamplingParams:
    message = types_pb2.SamplingParams(
        max_tokens=params.max_tokens if params.max_tokens is not None else 16,
        temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p,
        processed_logprobs=params.processed_logprobs,
    )
    if params.seed is not None:
        message.seed = params.seed
    stop = params.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if len(stop) == 0:
            message.stop_disabled = True
        elif all(isinstance(s, str) for s in stop):
            message.stop_strings.extend(stop)
        elif all(isinstance(s, (int, np.integer)) for s in stop):
            message.stop_token_ids = encode_tokens(stop)
        else:
            raise TypeError("stop must be strings or token ids, not a mix")
    return message


def sample_from_proto(message: types_pb2.SampleResponse) -> t.SampleResponse:
    sequences = []
    for s in message.sequences:
        topk = None
        if s.topk:
            ids = decode_tokens(s.topk_token_ids).reshape(-1, s.topk)
            lps = decode_floats(s.topk_logprobs).reshape(-1, s.topk)
            topk = [list(zip(row_ids.tolist(), row_lps.tolist())) for row_ids, row_lps in zip(ids, lps)]
        sequences.append(t.SampledSequence(stop_reason=_STOP.get(s.stop_reason, "length"), tokens=decode_tokens(s.tokens).tolist(),
                                           logprobs=decode_floats(s.logprobs).tolist(), topk_logprobs=topk, sequence_id=s.sequence_id,
                                           versions=spans_from_proto(s.versions)))
    prompt = logprobs_list(message.prompt_logprobs) if message.HasField("prompt_logprobs") else None
    top_prompt = None
    if message.HasField("topk_prompt_token_ids"):
        ids, lps = decode_array(message.topk_prompt_token_ids), decode_array(message.topk_prompt_logprobs)
        top_prompt = [None if row_lps[0] == TOPK_MASK_LOGPROB else list(zip(row_ids.tolist(), row_lps.tolist()))
                      for row_ids, row_lps in zip(ids, lps)]
    return t.SampleResponse(sequences=sequences, prompt_logprobs=prompt, topk_prompt_logprobs=top_prompt,
                            prompt_cache_hit_tokens=message.prompt_cache_hit_tokens)


def logprobs_list(message: types_pb2.Tensor) -> list[float | None]:
    return [None if np.isnan(x) else float(x) for x in decode_array(message)]


def checkpoint_from_proto(message: types_pb2.Checkpoint) -> t.Checkpoint:
    kind = "training" if message.kind == types_pb2.CHECKPOINT_KIND_TRAINING else "sampler"
    return t.Checkpoint(
        checkpoint_id=message.checkpoint_id, checkpoint_type=kind,
        time=datetime.fromtimestamp(message.created_unix_ms / 1000, tz=timezone.utc), tinker_path=message.path,
        training_run_id=message.training_run_id, size_bytes=message.size_bytes, public=message.published,
        expires_at=datetime.fromtimestamp(message.expires_unix_ms / 1000, tz=timezone.utc) if message.expires_unix_ms else None,
        user_metadata=dict(message.user_metadata) or None, base_model=message.base_model or None,
    )


def info_from_proto(message: service_pb2.TrainingRunInfo) -> t.GetInfoResponse:
    return t.GetInfoResponse(
        model_id=message.training_run_id,
        model_data=t.ModelData(model_name=message.base_model, tokenizer_id=message.tokenizer_id),
        lora_rank=message.lora_config.rank, lora_config=lora_from_proto(message.lora_config),
        next_seq_id=message.next_seq_id, vocab_size=message.vocab_size, max_context_length=message.max_context_length,
        deterministic=message.deterministic,
    )
