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
(``max_loaded_loras`` unset) and the servicer unloads the adapters it evicts.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from temper.common.errors import AdapterNotLoaded, Internal, InvalidArgument
from temper.services.models.loading import resolve_model_path
from temper.services.sampler.backend import ModelDescription, SampleRequest, SampleResult, SamplerBackend
from temper.services.sampler.settings import SamplerSettings
from temper.services.sampler.sglang_requests import (
    ENGINE_ENV,
    Batch,
    ModelFacts,
    build_batch,
    check_output,
    generate_error,
    parse_results,
    prompt_logprobs,
    scoring_item,
)

log = logging.getLogger(__name__)
SGLANG_VERSION = "0.5.23"  # keep equal to the pin of the `sglang` extra in pyproject.toml


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
        random_seed=0, log_level="error",
    )
    kwargs.update(settings.sglang_engine_args)
    return kwargs


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
    sources = [config.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    sources.append(AutoTokenizer.from_pretrained(model_path).eos_token_id)
    for ids in sources:
        eos.update([ids] if isinstance(ids, int) else ids or [])
    facts = ModelFacts(int(config.vocab_size), frozenset(eos), settings.sglang_deterministic,
                       settings.sglang_sampling_mask_max_tokens)
    return facts, int(getattr(config, "max_position_embeddings", 2048) or 2048)


class SGLangSamplerBackend(SamplerBackend):
    name = "sglang"

    def __init__(self, settings: SamplerSettings):
        self.base_model = settings.base_model
        self.model_path = resolve_model_path(settings.base_model)
        self.facts, self.max_context_length = model_facts(self.model_path, settings)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-engine")
        self._engine = self._call(start_engine, settings, self.model_path)
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
        )

    # ---- adapters -----------------------------------------------------------------------------

    def load_adapter(self, checkpoint_key: str, folder: Path) -> None:
        config, tensors = _read_adapter(folder)
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

    def _check_prompt(self, prompt: np.ndarray, max_tokens: int = 0) -> None:
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
        for r in requests:
            self._check_prompt(r.prompt, r.options.max_tokens)
        names = [self._lora_name(r.checkpoint_key) for r in requests]
        batch = build_batch(requests, names, self.facts)
        return parse_results(requests, batch, self._generate(batch))

    def compute_logprobs(self, checkpoint_key: str | None, prompt: np.ndarray, last_n: int | None = None) -> np.ndarray:
        self._check_prompt(prompt)
        item = scoring_item(prompt, self._lora_name(checkpoint_key), last_n)
        (out,) = self._generate(Batch([item]))
        check_output(out)
        return prompt_logprobs(len(prompt), item, out["meta_info"])


def _read_adapter(folder: Path) -> tuple[dict, dict]:
    """(adapter_config.json as a dict, {peft tensor name: CPU tensor}): the arguments of
    ``Engine.load_lora_adapter_from_tensors``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"not a peft LoRA adapter: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA" or not isinstance(config.get("r"), int):
        raise InvalidArgument("not a peft LoRA adapter: adapter_config.json needs peft_type LORA and an integer r")
    return config, tensors
