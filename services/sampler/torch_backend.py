"""Sampling with plain torch + transformers + peft: a KV-cached decode loop we control, so we can
return per-token logprobs, honour top-k/top-p/stop rules and make seeds reproducible."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel

from temper.common.errors import InvalidArgument, NotFound
from temper.services.models.loading import LoadedModel
from temper.services.sampler.backend import (
    GeneratedSequence,
    ModelDescription,
    SampleResult,
    SamplerBackend,
    SamplingOptions,
)


class TorchSamplerBackend(SamplerBackend):
    name = "torch"

    def __init__(self, loaded: LoadedModel, device: str = "cpu"):
        self.loaded = loaded
        self.device = torch.device(device)
        self.model: torch.nn.Module = loaded.model
        self._peft_names: dict[str, str] = {}
        self._names = (f"s{i}" for i in itertools.count())
        eos = loaded.model.generation_config.eos_token_id if loaded.model.generation_config else None
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if loaded.tokenizer.eos_token_id is not None:
            eos.append(loaded.tokenizer.eos_token_id)
        self.default_stop_ids = tuple(sorted(set(eos)))

    def describe(self) -> ModelDescription:
        return ModelDescription(
            base_model=self.loaded.name, tokenizer_id=self.loaded.path, vocab_size=self.loaded.vocab_size,
            max_context_length=self.loaded.max_context_length, loaded_adapters=sorted(self._peft_names),
        )

    # ---- adapters -----------------------------------------------------------------------------

    def load_adapter(self, adapter_id: str, folder: Path) -> None:
        if adapter_id in self._peft_names:
            self.drop_adapter(adapter_id)
        name = next(self._names)
        if isinstance(self.model, PeftModel):
            self.model.load_adapter(str(folder), adapter_name=name)
        else:
            self.model = PeftModel.from_pretrained(self.loaded.model, str(folder), adapter_name=name)
        self.model.eval()
        self._peft_names[adapter_id] = name

    def drop_adapter(self, adapter_id: str) -> None:
        name = self._peft_names.pop(adapter_id, None)
        if name is None:
            raise NotFound(f"adapter {adapter_id} is not loaded on this sampler")
        self.model.delete_adapter(name)

    @contextlib.contextmanager
    def _using(self, adapter_id: str | None):
        if adapter_id:
            if adapter_id not in self._peft_names:
                raise NotFound(f"adapter {adapter_id} is not loaded on this sampler")
            self.model.set_adapter(self._peft_names[adapter_id])
            yield self.model
        elif isinstance(self.model, PeftModel):
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model

    # ---- numerics -----------------------------------------------------------------------------

    def _check_prompt(self, prompt: np.ndarray) -> torch.Tensor:
        if prompt.size == 0:
            raise InvalidArgument("prompt is empty")
        vocab = self.loaded.vocab_size
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            raise InvalidArgument(f"prompt token ids must be in [0, {vocab})")
        return torch.from_numpy(prompt.astype(np.int64)).to(self.device)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
        out = np.full(ids.shape[0], np.nan, dtype=np.float32)
        if ids.shape[0] > 1:
            lp = logits[:-1].float().log_softmax(-1).gather(-1, ids[1:, None]).squeeze(-1)
            out[1:] = lp.cpu().numpy()
        return out

    @torch.no_grad()
    def compute_logprobs(self, adapter_id: str | None, prompt: np.ndarray) -> np.ndarray:
        ids = self._check_prompt(prompt)
        with self._using(adapter_id) as model:
            logits = model(input_ids=ids[None]).logits[0]
        return self._prompt_logprobs(logits, ids)

    @torch.no_grad()
    def sample(
        self, adapter_id: str | None, prompt: np.ndarray, num_samples: int, options: SamplingOptions, prompt_logprobs: bool
    ) -> SampleResult:
        ids = self._check_prompt(prompt)
        if len(prompt) + options.max_tokens > self.loaded.max_context_length:
            raise InvalidArgument(
                f"prompt ({len(prompt)}) + max_tokens ({options.max_tokens}) exceeds the context length {self.loaded.max_context_length}"
            )
        generator = torch.Generator(device=self.device)
        if options.seed is not None:
            generator.manual_seed(options.seed)
        else:
            generator.seed()
        stop_ids = set() if options.stop_disabled else set(options.stop_token_ids or ())
        if not options.stop_disabled and not options.stop_token_ids and not options.stop_strings:
            stop_ids = set(self.default_stop_ids)
        tokens = [[] for _ in range(num_samples)]
        logps = [[] for _ in range(num_samples)]
        reasons = ["length"] * num_samples
        alive = torch.ones(num_samples, dtype=torch.bool)
        with self._using(adapter_id) as model:
            out = model(input_ids=ids[None].expand(num_samples, -1), use_cache=True)
            prompt_lp = self._prompt_logprobs(out.logits[0], ids) if prompt_logprobs else None
            logits, past = out.logits[:, -1].float(), out.past_key_values
            for _ in range(options.max_tokens):
                raw = logits.log_softmax(-1)
                chosen = self._choose(logits, options, generator)
                chosen_lp = raw.gather(-1, chosen[:, None]).squeeze(-1)
                for row in torch.nonzero(alive).flatten().tolist():
                    tok = int(chosen[row])
                    tokens[row].append(tok)
                    logps[row].append(float(chosen_lp[row]))
                    if tok in stop_ids or self._hits_stop_string(tokens[row], options.stop_strings):
                        alive[row] = False
                        reasons[row] = "stop"
                if not alive.any():
                    break
                out = model(input_ids=chosen[:, None], past_key_values=past, use_cache=True)
                logits, past = out.logits[:, -1].float(), out.past_key_values
        sequences = [GeneratedSequence(t, lp, r) for t, lp, r in zip(tokens, logps, reasons)]
        return SampleResult(sequences, prompt_lp)

    @staticmethod
    def _choose(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator) -> torch.Tensor:
        if options.temperature == 0:
            return logits.argmax(-1)
        scaled = logits / options.temperature
        if options.top_k and options.top_k < scaled.shape[-1]:
            kth = scaled.topk(options.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if options.top_p < 1.0:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p (the first token always stays)
            drop = probs.cumsum(-1) - probs >= options.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
        probs = scaled.softmax(-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def _hits_stop_string(self, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
        if not stop_strings:
            return False
        # Only the tail can complete a stop string; decode enough of it to cover the longest one.
        tail = self.loaded.tokenizer.decode(tokens[-(max(len(s) for s in stop_strings) + 8) :])
        return any(s in tail for s in stop_strings)
