"""The torch sampler's deterministic decode (docs/deterministic.md): the batch-invariant primitives
and a ``DecodeCache`` whose rows hold their keys at their positions, so each sampled token's logprob
is ``torch.equal`` to the trainer's forward on the same tokens, alone or batched. Draws are the
usual ``_choose`` with each request's seeded generator. Prompt scoring, top-k alternatives, stop
strings and streaming are not part of it yet: such a request is refused, never answered approximately."""

from __future__ import annotations

import numpy as np
import torch

from temper.common.errors import FailedPrecondition
from temper.services.lora import deterministic as det
from temper.services.sampler.backend import GeneratedSequence, SampleRequest, SampleResult


def check(request: SampleRequest, model) -> None:
    missing = det.unsupported(model)
    extras = [name for name, on in (("prompt logprobs", request.prompt_logprobs or request.topk_prompt_logprobs),
                                    ("top-k logprobs", request.topk_logprobs), ("stop strings", request.options.stop_strings),
                                    ("processed_logprobs", request.options.processed_logprobs),
                                    ("streaming", request.progress is not None)) if on]
    if missing or extras:
        raise FailedPrecondition(f"deterministic sampling: {missing or 'not with ' + ', '.join(extras) + ' yet'}")


@torch.no_grad()
def sample(backend, requests: list[SampleRequest], choose) -> list[SampleResult]:
    """Every sequence of ``requests`` decoded together, right-padded, in deterministic mode."""
    model, device = backend.loaded.model, backend.device
    prompts, owners = [], []
    for n, r in enumerate(requests):
        check(r, model)
        prompts += [r.prompt] * r.num_samples
        owners += [n] * r.num_samples
    rows, width = len(prompts), max(len(p) for p in prompts)
    steps = max(r.options.max_tokens for r in requests)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = torch.from_numpy(p.astype(np.int64))
    generators = []
    for r in requests:
        g = torch.Generator(device=device)
        g.manual_seed(r.options.seed) if r.options.seed is not None else g.seed()
        generators.append(g)
    groups: dict = {}
    for row, n in enumerate(owners):
        groups.setdefault(requests[n].checkpoint_key, []).append(row)
    routing = [(key, torch.tensor(rs, device=device)) for key, rs in groups.items()]
    stops = [backend._stop_ids(r.options) for r in requests]
    tokens, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    reasons, alive = ["length"] * rows, [True] * rows
    cache = det.DecodeCache(rows, width + steps)
    with det.deterministic(model, cache), backend.lora.route(routing):
        logits = model(input_ids=ids, position_ids=torch.arange(width, device=device)[None].expand(rows, -1)).logits
        logits = logits[torch.arange(rows, device=device), lengths - 1].float()
        for step in range(steps):
            chosen = torch.zeros(rows, dtype=torch.long, device=device)
            for n, r in enumerate(requests):
                mine = torch.tensor([row for row, o in enumerate(owners) if o == n], device=device)
                chosen[mine] = choose(logits.index_select(0, mine), r.options, generators[n])[0]
            lp = det.target_logprobs(logits, chosen[:, None])[:, 0].tolist()
            for row, tok in enumerate(chosen.tolist()):
                if not alive[row]:
                    continue
                tokens[row].append(tok)
                logprobs[row].append(lp[row])
                if tok in stops[owners[row]]:
                    alive[row], reasons[row] = False, "stop"
                elif len(tokens[row]) >= requests[owners[row]].options.max_tokens:
                    alive[row] = False
            if not any(alive):
                break
            logits = model(input_ids=chosen[:, None], position_ids=(lengths + step)[:, None]).logits[:, -1].float()
    results = [SampleResult([], None) for _ in requests]
    for row, n in enumerate(owners):
        results[n].sequences.append(GeneratedSequence(tokens[row], logprobs[row], reasons[row], None, None))
    return results
