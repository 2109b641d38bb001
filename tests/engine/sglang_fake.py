"""A fake ``sglang`` package: exactly the SGLang calls ``services/sampler/sglang_backend.py`` makes,
with the shapes of sglang 0.5.23 (the version pinned in pyproject.toml), backed by the tiny model
through the torch backend so every number is real.

What it mirrors, and from where (paths under ``python/sglang/`` of the 0.5.23 wheel):
- ``sglang.Engine(**kwargs)``: kwargs are ServerArgs fields (``srt/arg_groups/fields/*.py``; an
  unknown one is a TypeError, as building ``ServerArgs`` is). ``Engine.loop`` and
  ``Engine.tokenizer_manager.generate_request(obj, request)``, an async generator whose first item
  is the whole answer (``srt/entrypoints/engine.py::Engine.generate``). ``shutdown()``.
- ``tp_size`` / ``dp_size`` (``srt/arg_groups/fields/parallel.py``): a TP size the model's attention
  heads cannot split over fails the bare asserts of ``srt/models/llama.py``; runtime adapter loading
  and unloading assert ``dp_size == 1`` (``srt/managers/tokenizer_control_mixin.py``).
- ``Engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict)`` and
  ``Engine.unload_lora_adapter(lora_name)`` answer ``LoRAUpdateOutput(success, error_message)``
  (``srt/managers/io_struct.py``); refusals come back as success=False, as
  ``srt/managers/tokenizer_control_mixin.py`` turns ValueErrors into results: LoRA not enabled,
  a name already loaded, rank over ``max_lora_rank`` or modules outside ``lora_target_modules``
  (``srt/lora/lora_manager.py::validate_new_adapter``), unloading an unknown name.
- ``sglang.srt.managers.io_struct.GenerateReqInput``: the fields Temper sets, per-item lists.
  ``generate_request`` raises ValueError for what ``TokenizerManager`` refuses: an adapter name not
  loaded ("The following requested LoRA adapters are not loaded", ``srt/lora/lora_registry.py``),
  a prompt at or over the context length, bad sampling params (``SamplingParams.verify``),
  ``sampling_logprobs_mode`` without ``return_sampling_mask``.
- Sampling (``srt/sampling/sampling_params.py``): temperature < 1e-6 is greedy (top_k 1);
  top_k -1 is the whole vocabulary; ``ignore_eos`` turns off every token stop; without it EOS ids
  and ``stop_token_ids`` stop; ``stop`` strings always; the stop token stays in ``output_ids``.
  ``sampling_seed`` counts only with ``enable_deterministic_inference`` (unseeded rows then use 42).
- Logprobs (``srt/layers/sampler.py``): sampled-token and top-k logprobs are
  ``log_softmax(logits / temperature)`` unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set (or the
  row is greedy), then ``log_softmax(logits)``; prompt logprobs are always raw. ``meta_info`` holds
  ``(logprob, token_id, None)`` triples; ``input_token_logprobs`` starts with ``None`` at
  ``logprob_start_len``; ``input_top_logprobs`` / ``output_top_logprobs`` per position;
  ``output_token_sampling_logprobs`` (with ``return_sampling_mask``, mode "selected") is the log
  probability under the processed distribution, needing a finite top_k <= ``sampling_mask_max_tokens``
  (``srt/managers/scheduler.py``); ``finish_reason`` ``{"type": "stop"|"length"|"abort", ...}``.

``FAIL_NEXT`` makes the next generate raise or abort, for the error-mapping tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__version__ = "0.5.23"
TOP_K_ALL = 1 << 30
SERVER_ARGS = {  # the ServerArgs fields the fake accepts (all exist at 0.5.23)
    "model_path", "tokenizer_path", "dtype", "device", "enable_lora", "max_lora_rank", "lora_target_modules",
    "max_loras_per_batch", "max_loaded_loras", "enable_deterministic_inference", "sampling_mask_max_tokens",
    "mem_fraction_static", "sampling_defaults", "random_seed", "log_level",
    "disable_shared_experts_fusion",  # srt/arg_groups/fields/exec_.py
    "tp_size", "dp_size",  # srt/arg_groups/fields/parallel.py
}
FAIL_NEXT: list = []   # exceptions to raise, or {"abort": (message, status)} dicts, one per generate call
ENGINES: list = []     # every Engine built (tests look inside)


@dataclass
class LoRAUpdateOutput:
    success: bool
    error_message: str | None = None
    loaded_adapters: dict | None = None


@dataclass
class GenerateReqInput:
    input_ids: list | None = None
    sampling_params: list | dict | None = None
    return_logprob: list | bool | None = None
    logprob_start_len: list | int | None = None
    top_logprobs_num: list | int | None = None
    lora_path: list | str | None = None
    return_sampling_mask: list | bool | None = None
    sampling_logprobs_mode: list | str | None = None
    image_data: list | None = None   # per item: a list of images (data URLs here), [] for a text item
    extra_key: list | str | None = None  # the radix cache's namespace (RadixKey.extra_key)
    stream: bool = False


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


class _TokenizerManager:
    def __init__(self, engine: "Engine"):
        self.engine = engine

    async def generate_request(self, obj: GenerateReqInput, request=None):
        outputs = self.engine._generate(obj)
        if not obj.stream:
            yield outputs
            return
        # srt/managers/tokenizer_manager.py::_handle_batch_request with stream: each item's output as it
        # grows, one dict at a time, tagged with the item's "index"; without incremental_streaming_output
        # (the default) output_ids and the output-side meta_info lists are the whole output so far, and
        # finish_reason is None until the item's last one
        longest = max((len(o["output_ids"]) for o in outputs), default=0)
        for step in range(1, longest + 1):
            for index, out in enumerate(outputs):
                n = len(out["output_ids"])
                if step <= n:
                    yield _output_so_far(out, step, index, last=step == n)
        for index, out in enumerate(outputs):
            if not out["output_ids"]:
                yield {**out, "index": index}


class Engine:
    def __init__(self, **kwargs):
        unknown = set(kwargs) - SERVER_ARGS
        if unknown:
            raise TypeError(f"ServerArgs got unexpected keyword arguments {sorted(unknown)}")
        from temper.services.models.loading import load_model
        from temper.services.sampler.torch_backend import TorchSamplerBackend

        self.args = kwargs
        self._check_tp(kwargs["model_path"], kwargs.get("tp_size", 1))
        self.original_logprob = _env_flag("SGLANG_RETURN_ORIGINAL_LOGPROB")  # read at import in sampler.py
        self.torch = TorchSamplerBackend(load_model(kwargs["model_path"]))
        self.loaded = self.torch.loaded
        self.adapters: dict[str, Path] = {}
        self.generate_calls: list[GenerateReqInput] = []
        self.radix: dict[tuple, list[list[int]]] = {}  # (extra_key, adapter) -> sequences held (_radix_hit)
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _TokenizerManager(self)
        self._scratch = Path(tempfile.mkdtemp(prefix="fake-sglang-"))
        self.alive = True
        ENGINES.append(self)

    @staticmethod
    def _check_tp(model_path: str, tp: int) -> None:
        """The bare asserts of srt/models/llama.py (qwen2.py alike) in each TP rank's model init."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path).get_text_config()  # a VL model's language model
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        assert heads % tp == 0
        if kv_heads >= tp:
            assert kv_heads % tp == 0
        else:
            assert tp % kv_heads == 0

    def _check_dynamic_lora(self) -> None:
        """srt/managers/tokenizer_control_mixin.py: an AssertionError (not a ValueError turned into a
        result), so it leaves Engine.load_lora_adapter_from_tensors / unload_lora_adapter as an exception."""
        assert self.args.get("dp_size", 1) == 1, "data-parallel replicas are not supported for dynamic lora loading"

    def shutdown(self):
        self.alive = False
        self.loop.close()

    # ---- LoRA -----------------------------------------------------------------------------------

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict, config_dict: dict, load_format=None):
        if not self.args.get("enable_lora"):
            return LoRAUpdateOutput(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        self._check_dynamic_lora()
        if lora_name in self.adapters:
            return LoRAUpdateOutput(False, f"LoRA adapter {lora_name} is already loaded")
        assert all(isinstance(t, torch.Tensor) for t in tensors.values()), "tensors are serialized as torch tensors"
        json.dumps(config_dict)  # LoadLoRAAdapterFromTensorsReqInput.config_dict is JSON
        if config_dict["r"] > self.args["max_lora_rank"]:
            return LoRAUpdateOutput(False, f"LoRA adapter {lora_name} has rank {config_dict['r']}, greater than "
                                           f"max_lora_rank {self.args['max_lora_rank']}")
        allowed = set(self.args["lora_target_modules"])
        if "all" not in allowed and not set(config_dict["target_modules"]) <= allowed:
            return LoRAUpdateOutput(False, f"LoRA adapter {lora_name} targets modules outside --lora-target-modules")
        from safetensors.torch import save_file

        folder = self._scratch / lora_name.replace("/", "_")
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps(config_dict))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        try:
            self.torch.load_adapter(lora_name, folder)
        except Exception as exc:  # noqa: BLE001 - lora_manager returns every failure as a result
            return LoRAUpdateOutput(False, str(exc))
        self.adapters[lora_name] = folder
        return LoRAUpdateOutput(True, loaded_adapters=dict.fromkeys(self.adapters, "__tensor__"))

    def unload_lora_adapter(self, lora_name: str):
        self._check_dynamic_lora()
        if lora_name not in self.adapters:
            return LoRAUpdateOutput(False, f"LoRA adapter {lora_name} is not registered")
        del self.adapters[lora_name]
        self.torch.drop_adapter(lora_name)
        return LoRAUpdateOutput(True, loaded_adapters=dict.fromkeys(self.adapters, "__tensor__"))

    # ---- generate -------------------------------------------------------------------------------

    def _generate(self, obj: GenerateReqInput) -> list[dict]:
        assert self.alive, "engine shut down"
        self.generate_calls.append(obj)
        if FAIL_NEXT:
            failure = FAIL_NEXT.pop(0)
            if isinstance(failure, BaseException):
                raise failure
        else:
            failure = None
        n = len(obj.input_ids)
        per_item = {k: (v if isinstance(v, list) else [v] * n) for k, v in vars(obj).items() if k != "input_ids"}
        for i in range(n):
            self._validate(obj.input_ids[i], per_item, i)
        outs = [self._one(obj.input_ids[i], {k: v[i] for k, v in per_item.items()}) for i in range(n)]
        if failure is not None:
            message, status = failure["abort"]
            outs[0]["meta_info"]["finish_reason"] = {"type": "abort", "message": message, "status_code": status,
                                                     "err_type": None}
        return outs

    def _validate(self, input_ids, per_item: dict, i: int) -> None:
        name = per_item["lora_path"][i]
        if name is not None and name not in self.adapters:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {self.adapters.keys()}.")
        sp = per_item["sampling_params"][i]
        ctx = self.loaded.max_context_length
        if len(input_ids) >= ctx:
            raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's context length ({ctx} tokens).")
        if not 0.0 < sp.get("top_p", 1.0) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {sp['top_p']}.")
        if sp.get("top_k", -1) < 1 and sp.get("top_k", -1) != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {sp['top_k']}.")
        if per_item["sampling_logprobs_mode"][i] is not None and not per_item["return_sampling_mask"][i]:
            raise ValueError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")

    def _one(self, input_ids: list[int], item: dict) -> dict:
        from temper.services.sampler.backend import SamplingOptions

        sp = dict(item["sampling_params"] or {})
        temperature, top_k = sp.get("temperature", 1.0), sp.get("top_k", -1)
        greedy = 0 <= temperature < 1e-6 or top_k == 1
        ignore_eos, stop_ids, strings = sp.get("ignore_eos", False), sp.get("stop_token_ids") or [], sp.get("stop") or []
        if isinstance(strings, str):
            strings = [strings]
        token_stops = set() if ignore_eos else set(stop_ids) | set(self.torch.default_stop_ids)
        mask = bool(item["return_sampling_mask"])
        if mask and not greedy and not 1 <= top_k <= self.args.get("sampling_mask_max_tokens", 4096):
            return self._abort(input_ids, "return_sampling_mask requires top_k=1 for greedy sampling or finite top_k", 400)
        seed = sp.get("sampling_seed") if self.args.get("enable_deterministic_inference") else None
        if self.args.get("enable_deterministic_inference") and seed is None:
            seed = 42
        options = SamplingOptions(
            max_tokens=sp.get("max_new_tokens", 128), seed=seed, temperature=0.0 if greedy else temperature,
            top_k=0 if top_k in (-1, TOP_K_ALL) else top_k, top_p=sp.get("top_p", 1.0), stop_strings=tuple(strings),
            stop_token_ids=tuple(sorted(token_stops)), stop_disabled=not token_stops and not strings,
            processed_logprobs=mask,
        )
        name = item["lora_path"]
        input_ids, images = self._expand_images(input_ids, item.get("image_data") or [])
        prompt = np.array(input_ids, dtype=np.int32)
        if options.max_tokens == 0:
            tokens, reason, processed = [], "length", []
        else:
            from temper.services.sampler.backend import SampleRequest

            [result] = self.torch.sample_batch([SampleRequest(name, prompt, 1, options, images=images)])
            seq = result.sequences[0]
            tokens, reason, processed = seq.tokens, seq.stop_reason, seq.logprobs
        meta = self._logprobs(name, input_ids, tokens, item, 1.0 if greedy or self.original_logprob else temperature, images)
        meta["finish_reason"] = {"type": reason, "matched": tokens[-1] if reason == "stop" and tokens else None}
        meta.update(prompt_tokens=len(input_ids), completion_tokens=len(tokens),
                    cached_tokens=self._radix_hit((item.get("extra_key"), name), input_ids + tokens, len(input_ids)))
        if mask:
            meta["output_token_sampling_logprobs"] = [float(x) for x in processed]
            meta["output_token_sampling_mask"] = [[t] for t in tokens]  # (the support ids; unused by Temper)
        return {"text": self.loaded.tokenizer.decode(tokens), "output_ids": tokens, "meta_info": meta}

    def _radix_hit(self, key, sequence: list[int], prompt_length: int) -> int:
        """The radix cache's answer (srt/mem_cache/radix_cache.py): the longest prefix of the prompt that an
        earlier sequence of the same (extra_key, adapter) holds, at most prompt_length - 1 (the last
        prompt token is always computed); the whole sequence is then kept."""
        held = self.radix.setdefault(key, [])
        hit = max((next((i for i, (a, b) in enumerate(zip(old, sequence)) if a != b), min(len(old), len(sequence)))
                   for old in held), default=0)
        held.append(list(sequence))
        return min(hit, prompt_length - 1)

    def _abort(self, input_ids, message, status) -> dict:
        return {"text": "", "output_ids": [], "meta_info": {
            "finish_reason": {"type": "abort", "message": message, "status_code": status, "err_type": None},
            "prompt_tokens": len(input_ids), "completion_tokens": 0, "input_token_logprobs": [], "output_token_logprobs": []}}

    def _expand_images(self, input_ids: list[int], image_data: list) -> tuple[list[int], tuple]:
        """``srt/multimodal/processors/base_processor.py::build_input_ids``: each position whose next token
        is the image token starts an image, whose N tokens replace that one image token (N from the
        model's processor). A count that does not match the images is refused (ValueError)."""
        if not image_data:
            return list(input_ids), ()
        import base64

        from temper.services.models import images as image_path

        vision = self.torch.loaded.vision
        starts = [i for i in range(len(input_ids) - 1) if input_ids[i + 1] == vision.tokens.image]
        if len(starts) != len(image_data):
            raise ValueError("Qwen-VL image artifacts do not match prompt placeholders")
        out, images, cur = [], [], 0
        for start, url in zip(starts, image_data):
            header, payload = url.split(",", 1)
            data, fmt = base64.b64decode(payload), header.removeprefix("data:image/").split(";")[0]
            width, height = image_path.open_image(data, fmt)
            n = vision.count(width, height)
            out += input_ids[cur:start + 1]
            images.append(image_path.ImageInput(len(out), n, data, fmt, width, height))
            out += [vision.tokens.image] * n
            cur = start + 2
        return out + list(input_ids[cur:]), tuple(images)

    @torch.no_grad()
    def _logprobs(self, name, input_ids, tokens, item, scale: float, images=()) -> dict:
        """Logprob fields from one forward over prompt + output (the same adapter route). Prompt positions
        hold the radix cache's pad values in place of image tokens, clamped into the vocabulary
        (``ScheduleBatch.prepare_for_extend``): they are scored against vocab_size - 1."""
        from temper.services.sampler import vision_inputs

        ids = torch.tensor([list(input_ids) + list(tokens)], dtype=torch.long)
        extra = (vision_inputs.prefill_inputs(self.torch, ids, torch.ones_like(ids), [(name, images)]).kwargs
                 if self.torch.loaded.vision is not None else {})
        with self.torch.lora.route([(name, None)]):
            logits = self.loaded.model(input_ids=ids, **extra).logits[0].float()
        if images:
            padded = self.loaded.vocab_size - 1
            input_ids = [padded if t == self.torch.loaded.vision.tokens.image else t for t in input_ids]
        raw, out_lp = logits.log_softmax(-1), (logits / scale).log_softmax(-1)
        n, k, start = len(input_ids), item["top_logprobs_num"] or 0, item["logprob_start_len"]
        triple = lambda lp, t: (float(lp), int(t), None)  # noqa: E731
        top = lambda row: [triple(v, t) for v, t in zip(*row.topk(k))] if k else None  # noqa: E731
        meta = {
            "output_token_logprobs": [triple(out_lp[n - 1 + j, t], t) for j, t in enumerate(tokens)],
            "input_token_logprobs": [], "input_top_logprobs": [],
        }
        if k:
            meta["output_top_logprobs"] = [top(out_lp[n - 1 + j]) for j in range(len(tokens))]
        if item["return_logprob"] and start is not None and start >= 0:
            meta["input_token_logprobs"] = [(None, int(input_ids[start]), None)] + [
                triple(raw[p - 1, input_ids[p]], input_ids[p]) for p in range(start + 1, n)]
            if k:
                meta["input_top_logprobs"] = [None] + [top(raw[p - 1]) for p in range(start + 1, n)]
        return meta


_OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_sampling_logprobs",
                 "output_token_sampling_mask")


def _output_so_far(out: dict, n: int, index: int, last: bool) -> dict:
    meta = {k: (v[:n] if k in _OUTPUT_LISTS else v) for k, v in out["meta_info"].items()}
    if not last:
        meta["finish_reason"] = None
    return {"output_ids": out["output_ids"][:n], "meta_info": meta, "index": index}


def install(monkeypatch) -> types.ModuleType:
    """Make ``import sglang`` (and ``sglang.srt.managers.io_struct``) find this fake."""
    me = sys.modules[__name__]
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.GenerateReqInput = GenerateReqInput
    io_struct.LoRAUpdateOutput = LoRAUpdateOutput
    srt, managers = types.ModuleType("sglang.srt"), types.ModuleType("sglang.srt.managers")
    srt.managers, managers.io_struct = managers, io_struct
    for name, module in {"sglang": me, "sglang.srt": srt, "sglang.srt.managers": managers,
                         "sglang.srt.managers.io_struct": io_struct}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(me, "srt", srt, raising=False)
    return me


