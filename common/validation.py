"""Request validation shared by scheduler and trainer: loss inputs, token ranges, Adam parameters.

Torch-free, so the scheduler rejects bad requests before they reach a trainer, and the trainer
checks the same rules again before touching an adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from temper.common.codec import decode_array, decode_tokens, dtype_name
from temper.common.errors import InvalidArgument, shown
from temper.common.prompt_scoring import MAX_TOPK_PROMPT_LOGPROBS, TOPK_MASK_LOGPROB, check_last_n, check_prompt_scoring  # noqa: F401 (re-exported)
from temper.services.models.images import DEFAULT_LIMITS, ImageInput, ImageLimits, VisionProcessor, flatten
from temper.v1 import types_pb2


@dataclass(frozen=True)
class LossSpec:
    required: dict[str, str]                       # input name -> dtype name
    optional: dict[str, str] = field(default_factory=dict)
    config: dict[str, float] = field(default_factory=dict)  # numeric config keys -> default
    top_k_targets: bool = False                    # accepts (N, K) target_tokens and weights


_RL_INPUTS = {"target_tokens": "int64", "logprobs": "float32", "advantages": "float32"}
LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(required={"target_tokens": "int64", "weights": "float32"}, top_k_targets=True),
    "importance_sampling": LossSpec(required=_RL_INPUTS),
    "ppo": LossSpec(required=_RL_INPUTS, config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(required=_RL_INPUTS, config={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(required=_RL_INPUTS, config={"beta": 0.05}),
    # GSPO's clipping ranges are the paper's (3e-4 / 4e-4): a length-normalised sequence ratio
    # stays near 1. Tinker's defaults are not published.
    "gspo": LossSpec(required=_RL_INPUTS, optional={"sequence_ratio_mask": "float32"},
                     config={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}),
    # Temper's stable_reinforce (services/trainer/losses.py): the per-sequence weight's truncation
    # range and an optional KL(sampler || current) penalty.
    "stable_reinforce": LossSpec(required=_RL_INPUTS,
                                 config={"clip_low_threshold": 0.0, "clip_high_threshold": 2.0, "kl_coeff": 0.0}),
}


# weights, advantages, logprobs, loss_fn_config numbers: beyond this a float32 loss and its gradient are not meaningful
MAX_LOSS_INPUT = 1e6
MAX_TOPK_LOGPROBS = 100    # top-k alternatives per generated position a sampler returns
# K of (N, K) top-k targets: the most a sampler returns per position, so any teacher's top-k fits;
# the trainer gathers a (B, T, K) logprob tensor for it.
MAX_TOPK_TARGETS = MAX_TOPK_LOGPROBS
# Adam's bounds: generous (Tinker's defaults are lr 1e-4, eps 1e-12), but each keeps a float32 step
# finite. torch casts lr into float32 (lr >= ~3.4e38 raises mid-step) and an eps that is 0 in
# float32 makes a zero gradient's update 0/0.
MAX_LEARNING_RATE = 10.0
MIN_EPS, MAX_EPS = 1e-30, 1e30


@dataclass
class DecodedDatum:
    tokens: np.ndarray                  # int32 (N,), each image as its image tokens
    inputs: dict[str, np.ndarray]       # loss_fn_inputs, each with leading dim N
    images: tuple[ImageInput, ...] = () # the images, in order, with where their tokens start


def model_input_tokens(model_input: types_pb2.ModelInput, vision: VisionProcessor | None = None,
                       limits: ImageLimits = DEFAULT_LIMITS, what: str = "model_input", **flatten_args) -> np.ndarray:
    """The input's tokens as the model sees them (images as their image tokens: ``images.flatten``)."""
    return flatten(model_input, vision, limits, what, **flatten_args).tokens


def check_token_range(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise InvalidArgument(f"{what}: token id {int(bad)} is outside the vocabulary [0, {vocab_size})")


def loss_config_values(loss_fn: str, config: dict[str, types_pb2.LossConfigValue]) -> dict[str, float]:
    spec = LOSS_SPECS[loss_fn]
    values = dict(spec.config)
    for key, value in config.items():
        if key not in spec.config:
            raise InvalidArgument(f"loss_fn_config key {shown(key, 40)} is not used by {loss_fn}; known: {sorted(spec.config)}")
        if value.WhichOneof("value") != "number" or not np.isfinite(value.number):
            raise InvalidArgument(f"loss_fn_config[{key!r}] must be a finite number")
        if abs(value.number) > MAX_LOSS_INPUT:  # a coefficient this large overflows the loss as a huge input would
            raise InvalidArgument(f"loss_fn_config[{key!r}] must be within +-{MAX_LOSS_INPUT:g}")
        values[key] = value.number
    if "clip_low_threshold" in values and not 0 <= values["clip_low_threshold"] <= values["clip_high_threshold"]:
        raise InvalidArgument(f"{loss_fn} needs 0 <= clip_low_threshold <= clip_high_threshold, got "
                              f"{values['clip_low_threshold']:g} and {values['clip_high_threshold']:g}")
    for key in ("beta", "kl_coeff"):
        if values.get(key, 0.0) < 0:
            raise InvalidArgument(f"{loss_fn} needs {key} >= 0, got {values[key]:g}")
    return values


def _names(names, most: int = 3) -> str:
    """Some of ``names`` for an error message: at most ``most``, each cut short (they are the caller's)."""
    listed = [shown(name, 40) for name in sorted(names)[:most]]
    more = f", ... ({len(names)} in all)" if len(names) > most else ""
    return f"[{', '.join(listed)}{more}]"


def validate_forward_backward(
    data, loss_fn: str, loss_fn_config, vocab_size: int, max_length: int | None = None,
    vision: VisionProcessor | None = None, limits: ImageLimits = DEFAULT_LIMITS, model: str = "the base model",
) -> tuple[list[DecodedDatum], dict[str, float]]:
    """Decode and check a forward_backward request; raise InvalidArgument on the first problem.
    ``vision``: the base model's (None: text only, an image is refused); images are checked by
    ``images.flatten`` (bytes, limits, expected_tokens against the model's processor)."""
    if loss_fn not in LOSS_SPECS:
        raise InvalidArgument(f"unknown loss_fn {shown(loss_fn)}; supported: {sorted(LOSS_SPECS)}")
    if not data:
        raise InvalidArgument("forward_backward needs at least one datum")
    spec = LOSS_SPECS[loss_fn]
    config = loss_config_values(loss_fn, dict(loss_fn_config))
    decoded = []
    for i, datum in enumerate(data):
        flat = flatten(datum.model_input, vision, limits, f"datum {i} model_input", model=model)
        tokens = flat.tokens
        n = len(tokens)
        if n == 0:
            raise InvalidArgument(f"datum {i}: model_input is empty")
        if max_length and n > max_length:
            raise InvalidArgument(f"datum {i}: {n} tokens exceed the model's context length {max_length}")
        check_token_range(tokens, vocab_size, f"datum {i} model_input")
        names = set(datum.loss_fn_inputs)
        missing = set(spec.required) - names
        if missing:
            raise InvalidArgument(f"datum {i}: {loss_fn} needs loss_fn_inputs {sorted(missing)}")
        unknown = names - set(spec.required) - set(spec.optional)
        if unknown:
            raise InvalidArgument(f"datum {i}: unknown loss_fn_inputs {_names(unknown)} for {loss_fn}")
        inputs = {}
        for name in names:
            tensor = datum.loss_fn_inputs[name]
            want = {**spec.required, **spec.optional}[name]
            if dtype_name(tensor.dtype) != want:
                raise InvalidArgument(f"datum {i}: {name} must be {want}, got {dtype_name(tensor.dtype)}")
            arr = decode_array(tensor)
            two_d = spec.top_k_targets and arr.ndim == 2 and 1 <= arr.shape[1] <= MAX_TOPK_TARGETS
            if not (arr.ndim == 1 or two_d) or arr.shape[0] != n:
                want = f"[{n}] or [{n}, K], 1 <= K <= {MAX_TOPK_TARGETS}" if spec.top_k_targets else f"[{n}]"
                raise InvalidArgument(f"datum {i}: {name} has shape {list(arr.shape)} but model_input has {n} tokens (expected {want})")
            peak = float(np.abs(arr).max()) if arr.dtype.kind == "f" and arr.size else 0.0  # a NaN or inf is the max
            if not math.isfinite(peak):
                raise InvalidArgument(f"datum {i}: {name} contains NaN or infinite values")
            if peak > MAX_LOSS_INPUT:
                raise InvalidArgument(f"datum {i}: {name} has values of magnitude {peak:.3g}; loss inputs "
                                      f"must be within +-{MAX_LOSS_INPUT:g} (larger ones overflow the loss in float32)")
            inputs[name] = arr
        shapes = {name: arr.shape for name, arr in inputs.items()}
        if len(set(shapes.values())) > 1:
            raise InvalidArgument(f"datum {i}: loss_fn_inputs shapes differ: {shapes}")
        if "target_tokens" in inputs:
            check_token_range(inputs["target_tokens"], vocab_size, f"datum {i} target_tokens")
        decoded.append(DecodedDatum(tokens=tokens, inputs=inputs, images=flat.images))
    return decoded, config


def validate_adam(params: types_pb2.AdamParams) -> None:
    values = [params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay, params.grad_clip_norm]
    if not all(math.isfinite(v) for v in values):
        raise InvalidArgument("Adam parameters must be finite")
    checks = [
        (0 <= params.learning_rate <= MAX_LEARNING_RATE, f"learning_rate must be in [0, {MAX_LEARNING_RATE:g}]"),
        (0 <= params.beta1 < 1 and 0 <= params.beta2 < 1, "beta1 and beta2 must be in [0, 1)"),
        (MIN_EPS <= params.eps <= MAX_EPS, f"eps must be in [{MIN_EPS:g}, {MAX_EPS:g}] (Adam divides by sqrt(v) + eps in "
                                           f"float32; an eps that rounds to 0 gives NaN for a zero gradient)"),
        (params.weight_decay >= 0, "weight_decay must be >= 0"),
        # AdamW multiplies the weights by 1 - lr * weight_decay: above 1 it flips their sign and grows them
        (params.learning_rate * params.weight_decay <= 1, "learning_rate * weight_decay must be <= 1"),
        (params.grad_clip_norm >= 0, "grad_clip_norm must be >= 0 (0 disables clipping)"),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidArgument(message)


# ---- sampling: checked by the scheduler before any sampler is called, and by the sampler again ----

MAX_NUM_SAMPLES = 64       # the sampler's default max_num_samples
MIN_TEMPERATURE = 1e-3     # below it logits / temperature overflow float32; use 0 for greedy


def check_sampling_params(p: types_pb2.SamplingParams, vocab_size: int) -> tuple[int, ...]:
    """The sampling parameters' rules; returns the stop token ids."""
    if p.max_tokens <= 0:
        raise InvalidArgument(f"max_tokens must be positive, got {p.max_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0 or 0 < p.temperature < MIN_TEMPERATURE:
        raise InvalidArgument(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {p.temperature:g}")
    if any(s == "" for s in p.stop_strings):
        raise InvalidArgument("stop strings must not be empty (an empty one would stop every sample at once)")
    if not 0 <= p.top_p <= 1:  # NaN too
        raise InvalidArgument(f"top_p must be in [0, 1], got {p.top_p:g}")
    stop_ids = decode_tokens(p.stop_token_ids)
    if stop_ids.size and (int(stop_ids.min()) < 0 or int(stop_ids.max()) >= vocab_size):
        raise InvalidArgument(f"stop token ids must be in [0, {vocab_size})")
    return tuple(int(t) for t in stop_ids)


def check_sample_counts(num_samples: int, topk_logprobs: int, topk_prompt_logprobs: int, vocab_size: int,
                        max_num_samples: int = MAX_NUM_SAMPLES) -> None:
    """How many samples and top-k alternatives a request asks for (``check_prompt_scoring`` bounds the prompt's k)."""
    if not 1 <= num_samples <= max_num_samples:
        raise InvalidArgument(f"num_samples must be in [1, {max_num_samples}], got {num_samples}")
    top = min(vocab_size, MAX_TOPK_LOGPROBS)
    if not 0 <= topk_logprobs <= top:
        raise InvalidArgument(f"topk_logprobs must be in [0, {top}], got {topk_logprobs}")
    if topk_prompt_logprobs > vocab_size:
        raise InvalidArgument(f"topk_prompt_logprobs must be at most the vocabulary size {vocab_size}")
