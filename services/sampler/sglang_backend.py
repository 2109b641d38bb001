"""The sampler backend over SGLang (``TEMPER_SAMPLER_BACKEND=sglang``; CUDA; ``pip install temper[sglang]``).

In-process ``sglang.Engine``, not a managed ``sglang.launch_server`` subprocess. Read at the pinned
version (0.5.23, ``srt/entrypoints/engine.py``), the Engine is the HTTP server minus HTTP: the same
TokenizerManager in this process, the same scheduler and detokenizer subprocesses (which it starts,
and kills with this process), the same continuous batching. What it adds for us:
- adapters load from tensors (``Engine.load_lora_adapter_from_tensors``, SGLang PR 16226): the
  pushed safetensors go to the GPU workers through shared memory, with no disk round trip and no
  base64-in-JSON as over ``/load_lora_adapter_from_tensors``;
- every GenerateReqInput field is reachable (the processed-logprob sampling mask is not a parameter of
  ``Engine.generate``; see ``_run_generate``);
- refusals arrive as Python exceptions and result objects (``ValueError``,
  ``LoRAUpdateOutput.success/error_message``), mapped to gRPC statuses in ``sglang_requests``, not as
  HTTP codes to re-parse;
- one process to supervise and health-check: the sampler is SERVING only once the engine is up,
  and a dead engine fails its calls (INTERNAL) instead of a subprocess we must watch and restart.
The cost: sglang's pinned torch / transformers must share the sampler's environment (the GPU image
installs ``.[server,sglang]``); the scheduler and trainer do not import it.

The Engine's synchronous methods drive its own asyncio loop (``loop.run_until_complete``), so the
engine is built and called on one dedicated thread (``_call``); the servicer's compute thread waits
on it. A batch of Temper requests is one ``Engine.generate`` call with per-item lists, so SGLang
decodes every adapter of the batch together (up to ``max_loras_per_batch`` per running batch).

Adapters: each pushed checkpoint version gets its own SGLang adapter name ``"<key>@<n>"``. A new
push of a key loads the new version under a new name, routes new requests to it, then unloads the
old one (SGLang waits for the requests still using it: ``LoRARegistry.wait_for_unload``).
Temper's ``residency.py`` alone decides what stays loaded: SGLang runs with no LRU of its own
(``max_loaded_loras`` unset) and the servicer unloads the adapters it evicts. An adapter SGLang would
accept but not serve as trained (LoRA on routed experts, per-module ranks, ...) is refused before it
reaches SGLang: ``check_servable`` (sglang_adapters.py), and docs/sglang_moe_lora.md for what 0.5.23 serves per family.

In-flight weights (docs/async_rl.md): each in-flight version is its own checkpoint key, so its own SGLang
adapter name; the servicer starts an in-flight request on its run's newest version. SGLang cannot move a
running request to another adapter, so ``SampleRequest.retarget`` is not asked: the request finishes on
the version it started on (one version span per sequence, ``sglang_requests``). ``between_steps`` is not
called either: a load runs on the engine's thread, which the running ``generate`` holds, so a push waits
for the batch that is generating.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from temper.common.errors import AdapterNotLoaded, FailedPrecondition, Internal, InvalidArgument
from temper.services.models.images import VisionProcessor
from temper.services.models.loading import resolve_model_path
from temper.services.sampler.backend import ModelDescription, SampleRequest, SampleResult, SamplerBackend
from temper.services.sampler.settings import SamplerConfigError, SamplerSettings
from temper.services.sampler import vision_inputs
from temper.services.sampler.sglang_adapters import SGLANG_VERSION, check_servable, read_adapter
from temper.services.sampler.sglang_images import check_scoring
from temper.services.sampler.sglang_requests import (
    ENGINE_ENV,
    Batch,
    ModelFacts,
    StreamedBatch,
    build_batch,
    check_output,
    check_prompt_length,
    generate_error,
    parse_results,
    prompt_logprobs,
    scoring_item,
)

log = logging.getLogger(__name__)
# SamplerModelInfo.deterministic_unsupported of every SGLang sampler (docs/deterministic.md)
DETERMINISTIC_UNSUPPORTED = (
    "the sglang sampler backend runs its own attention, matmul and sampling kernels, not the trainer's "
    "batch-invariant primitives: even with its deterministic-inference settings its logprobs cannot equal the "
    "trainer's bit for bit (use a torch-backend sampler for deterministic runs)")


def engine_kwargs(settings: SamplerSettings, model_path: str) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments (ServerArgs fields at the pinned version)."""
    kwargs: dict[str, Any] = dict(
        model_path=model_path, tokenizer_path=model_path, dtype=settings.dtype,
        enable_lora=True, max_lora_rank=settings.sglang_max_lora_rank,
        lora_target_modules=list(settings.sglang_lora_target_modules),
        max_loras_per_batch=settings.sglang_max_loras_per_batch, max_loaded_loras=None,
        enable_deterministic_inference=settings.sglang_deterministic,
        sampling_mask_max_tokens=settings.sglang_sampling_mask_max_tokens,
        mem_fraction_static=settings.sglang_mem_fraction_static,
        sampling_defaults="openai",  # never the model's generation_config: we send every field anyway
        # DeepSeek-V3: fused into the routed experts, the shared expert has no module to carry LoRA
        # (check_servable); other families have no shared expert to fuse
        disable_shared_experts_fusion=True,
        random_seed=0, log_level="error",
        tp_size=settings.tp_size, dp_size=settings.dp_size,
    )
    kwargs.update(settings.sglang_engine_args)
    return kwargs


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def check_parallel(settings: SamplerSettings, config, gpus: int) -> None:
    """Refuse (SamplerConfigError, naming the settings and numbers) a tensor- / data-parallel layout
    SGLang 0.5.23 would refuse late (an assert in a scheduler subprocess) or serve without Temper's
    runtime adapters. ``config``: the model's transformers config; ``gpus``: CUDA devices visible.

    As read in the 0.5.23 wheel (``python/sglang/srt/``):
    - ``managers/tokenizer_control_mixin.py``: ``load_lora_adapter_from_tensors`` and
      ``unload_lora_adapter`` assert ``dp_size == 1`` ("data-parallel replicas are not supported for
      dynamic lora loading"); every adapter this sampler serves is loaded at runtime, so dp_size > 1
      would serve the base model only. Scale out with more samplers (the scheduler spreads over them).
    - ``lora/lora_manager.py::validate_new_adapter`` asserts that adapters are pinned under attention
      DP (``attn_dp_size`` > 1, or the deprecated ``enable_dp_attention``); Temper's are not (it evicts).
    - LoRA with ``tp_size`` > 1 is supported: ``Engine._serialize_tensors_per_rank`` sends every TP
      rank its copy and ``lora/layers.py`` slices each rank's shard.
    - ``models/llama.py`` / ``qwen2.py``: ``num_attention_heads % tp_size == 0`` and the KV heads split
      over, or replicate across, the ranks (``num_key_value_heads % tp_size == 0`` or
      ``tp_size % num_key_value_heads == 0``): bare asserts in the scheduler otherwise.
    """
    extra = settings.sglang_engine_args
    moved = [k for k in ("tp_size", "dp_size") if k in extra]
    if moved:
        raise SamplerConfigError(f"set {', '.join(f'TEMPER_SAMPLER_{k.upper()}' for k in moved)} instead of "
                                 f"{', '.join(moved)} in TEMPER_SAMPLER_SGLANG_ENGINE_ARGS")
    tp, dp = settings.tp_size, settings.dp_size
    if dp > 1:
        raise SamplerConfigError(
            f"TEMPER_SAMPLER_DP_SIZE={dp}: SGLang {SGLANG_VERSION} loads LoRA adapters at runtime only with one "
            f"data-parallel replica (dp_size 1), and the sampler loads every adapter at runtime; run {dp} samplers "
            f"instead (the scheduler spreads requests over them), or split the model with TEMPER_SAMPLER_TP_SIZE")
    if extra.get("enable_dp_attention") or int(extra.get("attn_dp_size") or 1) > 1:
        raise SamplerConfigError(
            f"attention data parallelism (attn_dp_size / enable_dp_attention in TEMPER_SAMPLER_SGLANG_ENGINE_ARGS): "
            f"SGLang {SGLANG_VERSION} serves LoRA under it only from pinned adapters, and the sampler loads and "
            f"evicts its adapters at runtime")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        raise SamplerConfigError(f"TEMPER_SAMPLER_TP_SIZE={tp} does not divide the model's {heads} attention heads "
                                 f"(num_attention_heads); choose a divisor of {heads}")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise SamplerConfigError(f"TEMPER_SAMPLER_TP_SIZE={tp} neither divides nor is a multiple of the model's "
                                 f"{kv_heads} key/value heads (num_key_value_heads)")
    base, step = int(extra.get("base_gpu_id") or 0), int(extra.get("gpu_id_step") or 1)
    needed = base + (tp * dp - 1) * step + 1
    if tp * dp > 1 and needed > gpus:
        raise SamplerConfigError(f"TEMPER_SAMPLER_TP_SIZE={tp} x TEMPER_SAMPLER_DP_SIZE={dp} needs {needed} visible "
                                 f"GPUs (from base_gpu_id {base}, step {step}); {gpus} are visible")


def start_engine(settings: SamplerSettings, model_path: str):
    """Import sglang (only here: the CPU install never has it) and start its engine."""
    os.environ.update(ENGINE_ENV)  # before the import: srt/layers/sampler.py reads it at import time
    try:
        import sglang
    except ImportError as exc:
        raise RuntimeError(f"TEMPER_SAMPLER_BACKEND=sglang needs `pip install 'temper[sglang]'` "
                           f"(sglang {SGLANG_VERSION}, CUDA): {exc}") from exc
    version = getattr(sglang, "__version__", SGLANG_VERSION)
    if version != SGLANG_VERSION:
        log.warning("sglang %s is installed; Temper is written and tested against %s", version, SGLANG_VERSION)
    return sglang.Engine(**engine_kwargs(settings, model_path))


def model_facts(model_path: str, settings: SamplerSettings) -> tuple[ModelFacts, int]:
    """(facts, context length) from the model folder's config files, without loading weights: the
    same sources SGLang reads (``ModelConfig._get_hf_eos_token_id`` + the tokenizer's eos)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    eos: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    sources.append(AutoTokenizer.from_pretrained(model_path).eos_token_id)
    for ids in sources:
        eos.update([ids] if isinstance(ids, int) else ids or [])
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VL model's language model
    facts = ModelFacts(int(text.vocab_size), frozenset(eos), settings.sglang_deterministic,
                       settings.sglang_sampling_mask_max_tokens)
    return facts, int(getattr(text, "max_position_embeddings", 2048) or 2048)


class SGLangSamplerBackend(SamplerBackend):
    name = "sglang"

    def __init__(self, settings: SamplerSettings):
        self.base_model = settings.base_model
        self.model_path = resolve_model_path(settings.base_model)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path)
        check_parallel(settings, config, visible_gpus())
        self.vision = VisionProcessor.from_model(config, self.model_path)  # None: a text-only model
        self.tp_size, self.dp_size = settings.tp_size, settings.dp_size
        self.facts, self.max_context_length = model_facts(self.model_path, settings)
        args = engine_kwargs(settings, self.model_path)
        self._shared_experts_fused = bool(args.get("enforce_shared_experts_fusion")) or not (
            args.get("disable_shared_experts_fusion") or str(args.get("moe_runner_backend") or "").startswith("lora"))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-engine")
        self._engine = self._call(start_engine, settings, self.model_path)
        log.info("sglang engine up: tp_size=%d dp_size=%d", self.tp_size, self.dp_size)
        self._names: dict[str, str] = {}   # checkpoint key -> SGLang adapter name of its loaded version
        self._version = 0

    def _call(self, fn, *args, **kwargs):
        """Run on the engine's thread (its event loop lives there)."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._call(self._engine.shutdown)
        self._thread.shutdown()

    def describe(self) -> ModelDescription:
        return ModelDescription(
            base_model=self.base_model, tokenizer_id=self.model_path, vocab_size=self.facts.vocab_size,
            max_context_length=self.max_context_length, loaded_checkpoints=sorted(self._names),
            deterministic_unsupported=DETERMINISTIC_UNSUPPORTED, vision=self.vision,
        )

    # ---- adapters -----------------------------------------------------------------------------

    def check_adapter(self, folder: Path) -> None:
        config, tensors = read_adapter(folder)
        check_servable(config, tensors, shared_experts_fused=self._shared_experts_fused)

    def load_adapter(self, checkpoint_key: str, folder: Path) -> None:
        config, tensors = read_adapter(folder)
        check_servable(config, tensors, shared_experts_fused=self._shared_experts_fused)
        if config.get("target_parameters") and isinstance(config.get("target_modules"), list):
            # only linears' weights are left: SGLang reads target_modules alone, so list them there, where it
            # checks them against lora_target_modules (at load, not at the first batch)
            linears = {p.removesuffix(".weight").rsplit(".", 1)[-1] for p in config["target_parameters"]}
            config = {**config, "target_modules": sorted({*config["target_modules"], *linears}),
                      "target_parameters": None}
        self._version += 1
        name = f"{checkpoint_key}@{self._version}"
        result = self._call(self._engine.load_lora_adapter_from_tensors, name, tensors, config)
        if not result.success:
            raise InvalidArgument(f"sglang refused adapter {checkpoint_key}: {result.error_message}")
        old, self._names[checkpoint_key] = self._names.get(checkpoint_key), name
        if old is not None:  # the previous version: new requests already go to `name`
            self._unload(old)

    def drop_adapter(self, checkpoint_key: str) -> None:
        name = self._names.pop(checkpoint_key, None)
        if name is None:
            raise AdapterNotLoaded(checkpoint_key)
        self._unload(name)

    def _unload(self, name: str) -> None:
        result = self._call(self._engine.unload_lora_adapter, name)
        if not result.success:
            raise Internal(f"sglang could not unload adapter {name}: {result.error_message}")

    # ---- sampling -----------------------------------------------------------------------------

    def _lora_name(self, checkpoint_key: str | None) -> str | None:
        if not checkpoint_key:
            return None
        name = self._names.get(checkpoint_key)
        if name is None:
            raise AdapterNotLoaded(checkpoint_key)
        return name

    def _check_prompt(self, prompt: np.ndarray, max_tokens: int = 0, images=()) -> None:
        vision_inputs.check_images(prompt, images, self.vision, self.base_model)
        if prompt.size == 0:
            raise InvalidArgument("prompt is empty")
        vocab = self.facts.vocab_size
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            raise InvalidArgument(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + max_tokens > self.max_context_length:
            raise InvalidArgument(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context length "
                                  f"{self.max_context_length}")

    def _generate(self, batch: Batch) -> list[dict]:
        names = {i.lora_name for i in batch.items if i.lora_name}
        try:
            outputs = self._call(self._run_generate, batch.request_fields())
        except Exception as exc:  # noqa: BLE001 - mapped to the status it means
            raise generate_error(exc, names) from exc
        return outputs if isinstance(outputs, list) else [outputs]

    def _run_generate(self, fields: dict) -> list[dict]:
        """What ``Engine.generate`` does (engine.py: build a GenerateReqInput, run one step of
        ``tokenizer_manager.generate_request`` on the engine's loop), with the request built here:
        at 0.5.23 ``Engine.generate`` has no ``return_sampling_mask`` / ``sampling_logprobs_mode``
        parameters, which GenerateReqInput (and the HTTP /generate) accept."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        engine = self._engine
        generator = engine.tokenizer_manager.generate_request(GenerateReqInput(**fields), None)
        return engine.loop.run_until_complete(generator.__anext__())

    def sample(self, checkpoint_key, prompt, num_samples, options, prompt_logprobs) -> SampleResult:
        return self.sample_batch([SampleRequest(checkpoint_key, prompt, num_samples, options, prompt_logprobs)])[0]

    def sample_batch(self, requests: list[SampleRequest]) -> list[SampleResult]:
        if any(r.deterministic for r in requests):  # never a best effort (the servicer refuses them first)
            raise FailedPrecondition(f"deterministic sampling: {DETERMINISTIC_UNSUPPORTED}")
        for r in requests:
            self._check_prompt(r.prompt, r.options.max_tokens, r.images)
            if r.prompt_logprobs or r.topk_prompt_logprobs:
                last_n = r.prompt_logprobs_last_n
                check_scoring(r.prompt, r.images, 1 if last_n is None else len(r.prompt) - last_n)
        names = [self._lora_name(r.checkpoint_key) for r in requests]
        batch = build_batch(requests, names, self.facts)
        if not any(r.progress is not None for r in requests):
            return parse_results(requests, batch, self._generate(batch))
        # a batch with a streamed request is generated streaming: SGLang yields each item's output as it
        # grows (the same decode), told to the requests that stream (sglang_requests.StreamedBatch)
        streamed = StreamedBatch(requests, batch)
        names_used = {i.lora_name for i in batch.items if i.lora_name}
        try:
            self._call(self._run_generate_stream, {**batch.request_fields(), "stream": True}, streamed.take)
        except Exception as exc:  # noqa: BLE001 - mapped to the status it means
            raise generate_error(exc, names_used) from exc
        return parse_results(requests, batch, streamed.outputs())

    def _run_generate_stream(self, fields: dict, take) -> None:
        """``_run_generate`` streaming: every output SGLang yields goes to ``take``, on the engine's thread."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        engine = self._engine
        generator = engine.tokenizer_manager.generate_request(GenerateReqInput(**fields), None)
        while True:
            try:
                out = engine.loop.run_until_complete(generator.__anext__())
            except StopAsyncIteration:
                return
            take(out)

    def compute_logprobs(self, checkpoint_key: str | None, prompt: np.ndarray, last_n: int | None = None,
                         deterministic: bool = False, images=()) -> np.ndarray:
        if deterministic:
            raise FailedPrecondition(f"deterministic prompt scoring: {DETERMINISTIC_UNSUPPORTED}")
        self._check_prompt(prompt, 0, images)
        check_scoring(prompt, images, 1 if last_n is None else len(prompt) - last_n)
        item = scoring_item(prompt, self._lora_name(checkpoint_key), last_n, images)
        (out,) = self._generate(Batch([item]))
        check_output(out)
        check_prompt_length(item, out["meta_info"])
        return prompt_logprobs(len(prompt), item, out["meta_info"])
