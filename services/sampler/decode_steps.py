"""The torch sampler's decode steps after the prefill: each step samples every live row's next token
(per request: its options and seeded generator), records tokens, logprobs, top-k and stop reasons,
tells streamed requests their pieces, and runs one KV-cached forward for the next step.

Between two steps (before the forward), two things may happen (docs/async_rl.md): the servicer's pending
adapter installs run (``SampleRequest.between_steps``), and a request that follows a training run's
in-flight target (``SampleRequest.retarget``) moves to a newer version: its rows are routed to the new
adapter from that forward on, over the KV its earlier tokens left, and its next tokens start a new
version span. A token is attributed to the version whose forward computed the logits it was drawn from."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from temper.services.sampler.backend import (GeneratedSequence, Piece, SampleRequest, SampleResult, SamplingOptions,
                                             VersionSpan, WeightsVersion, add_token)


@dataclass
class _Live:
    """Decode state of one request inside a batch."""

    request: SampleRequest
    rows: list[int]
    stop_ids: set[int]
    generator: torch.Generator
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    topk_ids: list[list[list[int]]] = field(default_factory=list)
    topk_logprobs: list[list[list[float]]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)
    prompt_logprobs: np.ndarray | None = None
    topk_prompt: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
    prompt_cache_hit_tokens: int = 0
    key: str | None = field(init=False)              # the adapter its rows decode with now
    weights: WeightsVersion = field(init=False)      # ... and the version that adapter holds
    spans: list[list[VersionSpan]] = field(init=False)   # per row: its tokens' versions

    def __post_init__(self):
        self.key, self.weights = self.request.checkpoint_key, self.request.weights
        self.spans = [[] for _ in self.rows]


class _Route:
    """The batch's LoRA routing (LoraModel.route), entered again with new groups when rows move."""

    def __init__(self, lora, groups):
        self.lora, self._scope = lora, contextlib.ExitStack()
        self.switch(groups)

    def switch(self, groups) -> None:
        self._scope.close()
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(self.lora.route(groups))

    def close(self) -> None:
        self._scope.close()


@torch.no_grad()
def decode(backend, live: list[_Live], logits: torch.Tensor, past, mask: torch.Tensor, next_position: torch.Tensor,
           routing, steps: int) -> list[SampleResult]:
    """Decode ``live`` from the prefill's last ``logits`` and cache ``past`` for at most ``steps`` steps,
    rows routed to their adapters by ``routing`` (LoraModel.route)."""
    model, device = backend.loaded.model, backend.device
    rows_total = sum(len(s.rows) for s in live)
    # each request holds its own bound method of the one install queue: equal, not identical, so dedupe by equality
    hooks = list(dict.fromkeys(s.request.between_steps for s in live if s.request.between_steps))
    route = _Route(backend.lora, routing)
    try:
        for step in range(steps):
            chosen = torch.zeros(rows_total, dtype=torch.long, device=device)
            raw = logits.log_softmax(-1)
            reported = raw.clone()
            for state in live:
                rows = torch.tensor(state.rows, device=device)
                picked, processed = choose(logits.index_select(0, rows), state.request.options, state.generator)
                chosen[rows] = picked
                if state.request.options.processed_logprobs:
                    reported[rows] = processed
            chosen_lp = reported.gather(-1, chosen[:, None]).squeeze(-1).tolist()
            chosen_list = chosen.tolist()
            k_max = max(s.request.topk_logprobs for s in live)
            top = raw.topk(k_max, dim=-1) if k_max > 0 else None
            for state in live:
                grew = [] if state.request.progress is not None else None
                for k, row in enumerate(state.rows):
                    if not state.alive[k]:
                        continue
                    tok = chosen_list[row]
                    state.tokens[k].append(tok)
                    state.logprobs[k].append(chosen_lp[row])
                    add_token(state.spans[k], state.weights, len(state.tokens[k]) - 1)
                    if state.request.topk_logprobs:
                        kk = state.request.topk_logprobs
                        state.topk_ids[k].append(top.indices[row, :kk].tolist())
                        state.topk_logprobs[k].append(top.values[row, :kk].tolist())
                    if tok in state.stop_ids or backend._hits_stop_string(state.tokens[k], state.request.options.stop_strings):
                        state.alive[k], state.reasons[k] = False, "stop"
                    elif len(state.tokens[k]) >= state.request.options.max_tokens:
                        state.alive[k] = False
                    if grew is not None:
                        grew.append(k)
                if grew:
                    state.request.progress([_last_piece(state, k) for k in grew])
            if not any(any(s.alive) for s in live):
                break
            for hook in hooks:  # adapter installs, between this step's tokens and the next forward
                hook(frozenset(s.key for s in live if s.key))
            if _follow(live):
                route.switch(row_groups(live, device))
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = (next_position + step)[:, None]  # the row's length + its rotary delta, never cached state
            out = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            logits, past = out.logits[:, -1].float(), out.past_key_values
    finally:
        route.close()
    return [
        SampleResult([GeneratedSequence(t, lp, r, ti if s.request.topk_logprobs else None, tl if s.request.topk_logprobs else None,
                                        spans)
                      for t, lp, r, ti, tl, spans in zip(s.tokens, s.logprobs, s.reasons, s.topk_ids, s.topk_logprobs,
                                                         s.spans)],
                     s.prompt_logprobs, *s.topk_prompt, prompt_cache_hit_tokens=s.prompt_cache_hit_tokens)
        for s in live
    ]


def _follow(live: list[_Live]) -> bool:
    """Ask each following request with rows still decoding whether its run has a newer target; True if
    any moved (the routing must be rebuilt)."""
    moved = False
    for state in live:
        if state.request.retarget is None or not any(state.alive):
            continue
        target = state.request.retarget(state.weights)
        if target is not None and target[1] != state.weights:
            state.key, state.weights = target
            moved = True
    return moved


def row_groups(live: list[_Live], device) -> list[tuple[str | None, torch.Tensor]]:
    """(adapter key, rows) of the batch as its requests decode now."""
    groups: dict[str | None, list[int]] = {}
    for state in live:
        groups.setdefault(state.key, []).extend(state.rows)
    return [(key, torch.tensor(rows, device=device)) for key, rows in groups.items()]


def _last_piece(state: _Live, k: int) -> Piece:
    """What sequence ``k`` gained in this step: its last token (and, once it ended, why)."""
    topk = bool(state.request.topk_logprobs)
    n = len(state.tokens[k])
    return Piece(k, state.tokens[k][-1:], state.logprobs[k][-1:], None if state.alive[k] else state.reasons[k],
                 state.topk_ids[k][-1:] if topk else None, state.topk_logprobs[k][-1:] if topk else None,
                 [VersionSpan(state.weights, n - 1, 1)])


def choose(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled tokens and the log-distribution they were drawn from (after the processing)."""
    if options.temperature == 0:
        chosen = logits.argmax(-1)
        processed = torch.full_like(logits, float("-inf")).scatter(-1, chosen[:, None], 0.0)
        return chosen, processed
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
    return torch.multinomial(scaled.softmax(-1), 1, generator=generator).squeeze(-1), scaled.log_softmax(-1)
