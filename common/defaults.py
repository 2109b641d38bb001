"""Tinker's defaults for the request fields a client may leave unset (proto3 ``optional``: unset is
not 0). Applied in one place, where a request enters the scheduler and again where a worker decodes
it, so a raw gRPC client gets what the Tinker SDK would have sent (temper.client sends every field)."""

from __future__ import annotations

from temper.v1 import types_pb2

# tinker.AdamParams (docs: /work/shared/docs/tinker-wire-spec.md, section 4)
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}  # tinker.SamplingParams
LORA_DEFAULTS = {"rank": 32, "train_attn": True, "train_mlp": True, "train_unembed": True}  # tinker.LoraConfig
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def _filled(message, defaults: dict):
    """A copy of ``message`` with each unset field of ``defaults`` at its default (the request as
    received stays as it was: its bytes are what admission deduplicates and logs)."""
    filled = type(message)()
    filled.CopyFrom(message)
    for name, value in defaults.items():
        if not filled.HasField(name):
            setattr(filled, name, value)
    return filled


def adam_with_defaults(params: types_pb2.AdamParams) -> types_pb2.AdamParams:
    return _filled(params, ADAM_DEFAULTS)


def sampling_with_defaults(params: types_pb2.SamplingParams) -> types_pb2.SamplingParams:
    return _filled(params, SAMPLING_DEFAULTS)


def lora_with_defaults(config: types_pb2.LoraConfig) -> types_pb2.LoraConfig:
    return _filled(config, LORA_DEFAULTS)
