"""Sampling with plain torch + transformers: a KV-cached decode loop we control, so we return
per-token logprobs, honour top-k/top-p/stop rules, make seeds reproducible, and decode requests
for different checkpoints together in one batch (rows routed to their checkpoint's LoRA weights by
the LoRA layer, which keys them by checkpoint key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from temper.common.errors import AdapterNotLoaded, InvalidArgument
from temper.common.prompt_scoring import TOPK_MASK_LOGPROB, check_last_n, check_prompt_scoring
from temper.services.lora.deterministic import unsupported as deterministic_unsupported
from temper.services.lora.model import LoraModel
from temper.services.models.loading import LoadedModel
from temper.services.sampler import decode_steps, deterministic_decode, prompt_prefill, vision_inputs
from temper.services.sampler.decode_steps import _Live, choose as _choose
from temper.services.sampler.prefix_cache import CacheScope, PrefixCache
from temper.services.sampler.backend import (
    GeneratedSequence,
    ModelDescription,
    Piece,
    SampleRequest,
    SampleResult,
    SamplerBackend,
    SamplingOptions,
)


class TorchSamplerBackend(SamplerBackend):
    name = "torch"

    def __init__(self, loaded: LoadedModel, device: str = "cpu", prefix_cache_bytes: int = 0):
        self.loaded = loaded
        self.device = torch.device(device)
        self.lora = LoraModel(loaded.model, loaded.name)
        # text models with a plain KV cache prefill each distinct prompt once, through the prefix cache
        # (prompt_prefill.py); vision models keep the batched prefill (their positions are multimodal)
        self.prompt_prefill = (loaded.vision is None
                               and prompt_prefill.supports_prompt_prefill(loaded.model, self.lora, self.device))
        self.prefix_cache = PrefixCache(prefix_cache_bytes if self.prompt_prefill else 0)
        # bumped on every (re)load of a key: a new version of an adapter never reads its old KV
        self.adapter_generation: dict[str, int] = {}
        eos = loaded.model.generation_config.eos_token_id if loaded.model.generation_config else None
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if loaded.tokenizer.eos_token_id is not None:
            eos.append(loaded.tokenizer.eos_token_id)
        self.default_stop_ids = tuple(sorted(set(eos)))
        deterministic_unsupported(loaded.model)  # the row-invariance check (seconds for a large model) before serving, not in GetModelInfo

    def describe(self) -> ModelDescription:
        vision = self.loaded.vision
        return ModelDescription(
            base_model=self.loaded.name, tokenizer_id=self.loaded.path, vocab_size=self.loaded.vocab_size,
            max_context_length=self.loaded.max_context_length, loaded_checkpoints=sorted(self.lora.adapters),
            deterministic_unsupported=(vision_inputs.deterministic_refusal(self.loaded.model) if vision is not None
                                       else deterministic_unsupported(self.loaded.model)),
            vision=vision,
        )

    # ---- adapters -----------------------------------------------------------------------------

    def check_adapter(self, folder: Path) -> None:
        spec, weights = self._read(folder)
        try:
            expected = self.lora.param_shapes(self.lora.resolve(spec))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        got = {name: tuple(t.shape) for name, t in weights.items()}
        if got != expected:
            wrong = sorted(set(got) ^ set(expected)) or sorted(n for n in got if got[n] != expected[n])
            raise InvalidArgument(f"adapter tensors do not match its config on this model: {wrong[:3]}")

    @staticmethod
    def _read(folder: Path):
        try:
            return LoraModel.read(folder)
        except (ValueError, KeyError, OSError) as exc:
            raise InvalidArgument(f"not a peft LoRA adapter: {exc}") from None

    def load_adapter(self, checkpoint_key: str, folder: Path) -> None:
        spec, weights = self._read(folder)
        self._forget_prefixes(checkpoint_key)
        if checkpoint_key in self.lora.adapters:
            self.lora.remove(checkpoint_key)
        try:
            self.lora.add(checkpoint_key, spec)
            self.lora.load_weights(checkpoint_key, weights)
        except ValueError as exc:
            self.lora.remove(checkpoint_key) if checkpoint_key in self.lora.adapters else None
            raise InvalidArgument(str(exc)) from None

    def drop_adapter(self, checkpoint_key: str) -> None:
        if checkpoint_key not in self.lora.adapters:
            raise AdapterNotLoaded(checkpoint_key)
        self._forget_prefixes(checkpoint_key)
        self.lora.remove(checkpoint_key)

    def _forget_prefixes(self, checkpoint_key: str) -> None:
        self.adapter_generation[checkpoint_key] = self.adapter_generation.get(checkpoint_key, 0) + 1
        self.prefix_cache.drop_adapter(checkpoint_key)

    def _cache_scope(self, r: SampleRequest) -> CacheScope | None:
        """Where ``r``'s prompt KV may be reused: its tenant's sampling session on this adapter version;
        None (not cached) without a session (a caller that names none) or for prompts with images."""
        if not r.cache_session or r.images:
            return None
        return CacheScope(r.tenant, r.cache_session, r.checkpoint_key,
                          self.adapter_generation.get(r.checkpoint_key, 0) if r.checkpoint_key else 0)

    def _check(self, checkpoint_key: str | None, prompt: np.ndarray, images=(), deterministic: bool = False) -> None:
        if checkpoint_key and checkpoint_key not in self.lora.adapters:
            raise AdapterNotLoaded(checkpoint_key)
        if prompt.size == 0:
            raise InvalidArgument("prompt is empty")
        vocab = self.loaded.vocab_size
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            raise InvalidArgument(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) > self.loaded.max_context_length:
            raise InvalidArgument(f"prompt has {len(prompt)} tokens; the context length is {self.loaded.max_context_length}")
        vision_inputs.check_images(prompt, images, self.loaded.vision, self.loaded.name)
        vision_inputs.check_deterministic(self.loaded.model, self.loaded.vision, deterministic)

    # ---- numerics -----------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, checkpoint_key: str | None, prompt: np.ndarray, last_n: int | None = None,
                         deterministic: bool = False, images=()) -> np.ndarray:
        self._check(checkpoint_key, prompt, images, deterministic)
        if last_n is not None:
            check_last_n(len(prompt), last_n)
        if deterministic:  # alone, at its true length, with the batch-invariant primitives
            return deterministic_decode.score_prompt(self, checkpoint_key, prompt, last_n)[0]
        ids = torch.from_numpy(prompt.astype(np.int64)).to(self.device)[None]
        extra = (vision_inputs.prefill_inputs(self, ids, torch.ones_like(ids), [(checkpoint_key, tuple(images))]).kwargs
                 if self.loaded.vision is not None else {})
        with self.lora.route([(checkpoint_key, None)]):
            logits = self.loaded.model(input_ids=ids, **extra).logits[0]
        return _prompt_logprobs(logits, ids[0], last_n)[0]

    def sample(self, checkpoint_key, prompt, num_samples, options, prompt_logprobs) -> SampleResult:
        return self.sample_batch([SampleRequest(checkpoint_key, prompt, num_samples, options, prompt_logprobs)])[0]

    @torch.no_grad()
    def sample_batch(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Decode every sequence of every request in one left-padded, KV-cached batch."""
        for r in requests:
            self._check(r.checkpoint_key, r.prompt, r.images, r.deterministic)
            check_prompt_scoring(len(r.prompt), r.prompt_logprobs, r.topk_prompt_logprobs, r.prompt_logprobs_last_n)
            if len(r.prompt) + r.options.max_tokens > self.loaded.max_context_length:
                raise InvalidArgument(
                    f"prompt ({len(r.prompt)}) + max_tokens ({r.options.max_tokens}) exceeds the context length "
                    f"{self.loaded.max_context_length}"
                )
        if any(r.deterministic for r in requests):  # decoded apart, with the batch-invariant primitives
            exact = [r for r in requests if r.deterministic]
            answers = dict(zip(map(id, exact), deterministic_decode.sample(self, exact, _choose)))
            rest = [r for r in requests if not r.deterministic]
            answers.update(zip(map(id, rest), self.sample_batch(rest) if rest else []))
            return [answers[id(r)] for r in requests]
        width = max(len(r.prompt) for r in requests)
        live, prompts = [], []
        for r in requests:
            rows = list(range(len(prompts), len(prompts) + r.num_samples))
            prompts += [r.prompt] * r.num_samples
            generator = torch.Generator(device=self.device)
            generator.manual_seed(r.options.seed) if r.options.seed is not None else generator.seed()
            live.append(_Live(r, rows, self._stop_ids(r.options), generator, [[] for _ in rows], [[] for _ in rows],
                              [[] for _ in rows], [[] for _ in rows], ["length"] * len(rows), [True] * len(rows)))
        sizes = np.array([len(p) for p in prompts])  # left padding keeps every row's last token aligned
        mask = torch.from_numpy(np.arange(width)[None] >= (width - sizes)[:, None]).to(self.device, torch.long)
        ids = None
        if not self.prompt_prefill:  # the per-row token grid only the batched prefill reads (prompt_prefill.py builds its own)
            grid = np.zeros((len(prompts), width), dtype=np.int64)
            for row, prompt in enumerate(prompts):
                grid[row, width - len(prompt):] = prompt
            ids = torch.from_numpy(grid).to(self.device)
        lengths = torch.from_numpy(sizes).to(self.device)
        if self.loaded.vision is not None:  # explicit multimodal positions, text-only rows too (vision_inputs.py)
            row_inputs = [(s.request.checkpoint_key, s.request.images) for s in live for _ in s.rows]
            prefill = vision_inputs.prefill_inputs(self, ids, mask, row_inputs)
            extra, next_position = prefill.kwargs, lengths + prefill.deltas
        else:
            extra, next_position = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, lengths
        routing = decode_steps.row_groups(live, self.device)
        steps = max(r.options.max_tokens for r in requests)
        if self.prompt_prefill:
            logits, past = self._prefill_each(live, width)
        else:
            with self.lora.route(routing):
                logits, past = self._prefill_batched(live, ids, mask, extra, width)
        return decode_steps.decode(self, live, logits, past, mask, next_position, routing, steps)

    # False: each missed prompt prefilled alone, one forward each (benchmarks/prefix_cache.py's control)
    batch_missed_prompts = True

    def _prefill_each(self, live: list[_Live], width: int):
        """Each distinct prompt once, through the prefix cache (prompt_prefill.py): the first step's
        logits per row and the left-padded batch cache."""
        requests = [state.request for state in live]
        done = prompt_prefill.prefill(self.loaded.model, self.lora, self.device, requests,
                                      [self._cache_scope(r) for r in requests], self.prefix_cache,
                                      together=self.batch_missed_prompts)
        for state, prompt in zip(live, done.prompts):
            state.prompt_cache_hit_tokens = prompt.hit_tokens
            if prompt.prompt_logits is not None:
                ids = torch.from_numpy(state.request.prompt.astype(np.int64)).to(self.device)
                self._keep_prompt_scores(state, prompt.prompt_logits, ids)
        if done.past is not None:
            return done.logits, done.past
        logits = torch.cat([p.last_logits[None].expand(len(s.rows), -1) for p, s in zip(done.prompts, live)])
        return logits, prompt_prefill.padded_past([p.kv for p in done.prompts], [s.rows for s in live], width)

    def _prefill_batched(self, live: list[_Live], ids, mask, extra, width: int):
        """Every row's prompt in one left-padded forward (vision models, caches that cannot be sliced)."""
        out = self.loaded.model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)
        for state in live:
            n = len(state.request.prompt)
            if state.request.prompt_logprobs or state.request.topk_prompt_logprobs:
                self._keep_prompt_scores(state, out.logits[state.rows[0], width - n:], ids[state.rows[0], width - n:])
        return out.logits[:, -1].float(), out.past_key_values

    @staticmethod
    def _keep_prompt_scores(state: _Live, logits: torch.Tensor, ids: torch.Tensor) -> None:
        r = state.request
        scored, top_ids, top_lps = _prompt_logprobs(logits, ids, r.prompt_logprobs_last_n, r.topk_prompt_logprobs)
        state.prompt_logprobs = scored if r.prompt_logprobs else None
        state.topk_prompt = (top_ids, top_lps)

    def _stop_ids(self, options: SamplingOptions) -> set[int]:
        if options.stop_disabled:
            return set()
        if options.stop_token_ids or options.stop_strings:
            return set(options.stop_token_ids)
        return set(self.default_stop_ids)

    def _hits_stop_string(self, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
        if not stop_strings:
            return False
        # Only the tail can complete a stop string; decode enough of it to cover the longest one.
        tail = self.loaded.tokenizer.decode(tokens[-(max(len(s) for s in stop_strings) + 8):])
        return any(s in tail for s in stop_strings)


PROMPT_CHUNK = 512  # prompt positions scored per log_softmax: bounds the (positions, vocab) float32 temporary


def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, last_n: int | None = None,
                     topk: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Score prompt positions [n - last_n, n) (all but position 0 by default): log p(ids[i] | ids[:i])
    from logits[i - 1], and with ``topk`` the k most likely tokens there. Unscored positions hold NaN
    (logprobs) and id 0 / TOPK_MASK_LOGPROB (top-k)."""
    n = ids.shape[0]
    first = 1 if last_n is None else max(n - last_n, 1)
    out = np.full(n, np.nan, dtype=np.float32)
    top_ids = np.zeros((n, topk), dtype=np.int32) if topk else None
    top_lps = np.full((n, topk), TOPK_MASK_LOGPROB, dtype=np.float32) if topk else None
    for start in range(first, n, PROMPT_CHUNK):
        stop = min(start + PROMPT_CHUNK, n)
        lp = logits[start - 1:stop - 1].float().log_softmax(-1)
        out[start:stop] = lp.gather(-1, ids[start:stop, None]).squeeze(-1).cpu().numpy()
        if topk:
            values, indices = lp.topk(topk, dim=-1)
            top_ids[start:stop], top_lps[start:stop] = indices.cpu().numpy(), values.cpu().numpy()
    return out, top_ids, top_lps
