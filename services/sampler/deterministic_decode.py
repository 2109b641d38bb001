"""The torch sampler's deterministic mode (docs/deterministic.md): the batch-invariant primitives and
a ``DecodeCache`` whose rows hold their keys at their positions, so each sampled token's logprob is
``torch.equal`` to the trainer's forward on the same tokens, alone or batched. Draws are the usual
``_choose`` with each request's seeded generator, on that request's rows only.

Prompt scoring (``score_prompt``: compute_logprobs, a sample request's prompt logprobs and top-k
prompt logprobs) runs each prompt's forward alone at its true length inside the deterministic scope
and takes log p(target) with ``deterministic.target_logprobs``, as the trainer scores a deterministic
datum, so the numbers are ``torch.equal`` to its forward logprobs on the same tokens. Top-k
alternatives are the same formula at the k largest logits' ids; processed logprobs come from the
request's own rows (batch-invariant, but the processed distribution, not the trainer's); stop strings
and streaming are the default decode's rules. A family without batch-invariant kernels is refused.

Each prompt's prefill runs once, alone at its length, for all of its samples (``_prefill``); the decode
steps run every row of the batch together (the adapters stacked: ``deterministic_lora``)."""

from __future__ import annotations

from concurrent.futures import wait as futures_wait

import numpy as np
import torch

from temper.common.errors import FailedPrecondition
from temper.common.prompt_scoring import TOPK_MASK_LOGPROB
from temper.services.lora import deterministic as det
from temper.services.sampler.backend import GeneratedSequence, Piece, SampleRequest, SampleResult

PROMPT_CHUNK = 512  # prompt positions per logsumexp: bounds the float32 temporaries (rows are independent)


def check(model, what: str = "sampling") -> None:
    missing = det.unsupported(model)
    if missing:
        raise FailedPrecondition(f"deterministic {what}: {missing}")


@torch.no_grad()
def score_prompt(backend, checkpoint_key: str | None, prompt: np.ndarray, last_n: int | None = None,
                 topk: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """log p(prompt[i] | prompt[:i]) for positions [n - last_n, n) (all but 0 by default), NaN elsewhere,
    and with ``topk`` the k most likely tokens there (unscored rows: id 0 and TOPK_MASK_LOGPROB): the
    prompt's forward alone, at its true length, with the batch-invariant primitives."""
    model, device = backend.loaded.model, backend.device
    check(model, "prompt scoring")
    n = len(prompt)
    first = 1 if last_n is None else max(n - last_n, 1)
    out = np.full(n, np.nan, dtype=np.float32)
    top_ids = np.zeros((n, topk), dtype=np.int32) if topk else None
    top_lps = np.full((n, topk), TOPK_MASK_LOGPROB, dtype=np.float32) if topk else None
    if first >= n:
        return out, top_ids, top_lps
    ids = torch.from_numpy(prompt.astype(np.int64)).to(device)
    with det.deterministic(model), backend.lora.route([(checkpoint_key, None)]):
        logits = model(input_ids=ids[None], position_ids=torch.arange(n, device=device)[None]).logits[0]
        for start in range(first, n, PROMPT_CHUNK):
            stop = min(start + PROMPT_CHUNK, n)
            rows = logits[start - 1:stop - 1].float()
            out[start:stop] = det.target_logprobs(rows, ids[start:stop, None])[:, 0].cpu().numpy()
            if topk:
                indices = rows.topk(topk, dim=-1).indices
                top_ids[start:stop] = indices.cpu().numpy()
                top_lps[start:stop] = det.target_logprobs(rows, indices).cpu().numpy()
    return out, top_ids, top_lps


@torch.no_grad()
def sample(backend, requests: list[SampleRequest], choose, workers: int = 0) -> list[SampleResult]:
    """Every sequence of ``requests`` decoded in deterministic mode: the requests split into up to
    ``workers`` parts (0: the process's intra-op thread count) and no more than rows // MIN_ROWS,
    balanced by rows, decoded side by side, each part's rows together on a thread of its own with one
    intra-op thread.
    A row's numbers do not depend on the other rows of its batch (each part's matmuls still take
    >= MIN_ROWS rows), and a request's rows, its generator and its progress stay in one part: the same
    bits as one batch. Fewer rows are one batch: a part of fewer would be padded to MIN_ROWS, adding
    base-model work (measured with a 16-row floor, 8 rows in two padded parts: ~40% more CPU time,
    slower on a loaded machine)."""
    model = backend.loaded.model
    check(model)
    scored = [score_prompt(backend, r.checkpoint_key, r.prompt, r.prompt_logprobs_last_n, r.topk_prompt_logprobs)
              if r.prompt_logprobs or r.topk_prompt_logprobs else (None, None, None) for r in requests]
    rows = sum(r.num_samples for r in requests)
    parts = _split(requests, min(len(requests), rows // det.MIN_ROWS, workers or torch.get_num_threads()))
    if len(parts) == 1:
        decoded = _decode(backend, requests, choose, lambda cache: det.deterministic(model, cache))
    else:
        decoded = [None] * len(requests)
        pool = det.worker_pool(len(parts))
        # the model's attention switch and the process's one thread, held while the parts run
        with det.deterministic(model):
            futures = [pool.submit(_decode, backend, [requests[n] for n in part], choose, det.on_this_thread)
                       for part in parts]
            try:
                for part, future in zip(parts, futures):
                    for n, sequences in zip(part, future.result()):
                        decoded[n] = sequences
            finally:  # on a failure, no part may still run when the scope restores the thread count
                futures_wait(futures)
    return [SampleResult(sequences, prompt_lps if r.prompt_logprobs else None, prompt_top_ids, prompt_top_lps)
            for r, sequences, (prompt_lps, prompt_top_ids, prompt_top_lps) in zip(requests, decoded, scored)]


def _split(requests: list[SampleRequest], parts: int) -> list[list[int]]:
    """Request indices in up to ``parts`` parts of about equal rows (a part's matmuls cost by its rows
    padded to MIN_ROWS; its steps by its longest request), each in order."""
    if parts <= 1:
        return [list(range(len(requests)))]
    work = [0] * parts
    owner: dict[int, int] = {}
    for n in sorted(range(len(requests)), key=lambda n: _work(requests[n]), reverse=True):
        k = min(range(parts), key=work.__getitem__)
        owner[n], work[k] = k, work[k] + requests[n].num_samples
    return [part for part in ([n for n in range(len(requests)) if owner[n] == k] for k in range(parts)) if part]


def _work(r: SampleRequest) -> tuple[int, int]:
    return r.num_samples, len(r.prompt) + r.options.max_tokens


@torch.no_grad()  # grad mode is per thread: a worker's too
def _decode(backend, requests: list[SampleRequest], choose, scope) -> list[list[GeneratedSequence]]:
    """``requests``' sequences decoded together, right-padded, inside ``scope(cache)`` (the primitives' switch and
    one intra-op thread: ``det.deterministic`` on the calling thread, ``det.on_this_thread`` on a worker)."""
    model, device = backend.loaded.model, backend.device
    prompts, owners, index = [], [], []
    for n, r in enumerate(requests):
        prompts += [r.prompt] * r.num_samples
        owners += [n] * r.num_samples
        index += range(r.num_samples)
    rows, width = len(prompts), max(len(p) for p in prompts)
    steps = max(r.options.max_tokens for r in requests)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    generators = []
    for r in requests:
        g = torch.Generator(device=device)
        g.manual_seed(r.options.seed) if r.options.seed is not None else g.seed()
        generators.append(g)
    groups: dict = {}
    for row, n in enumerate(owners):
        groups.setdefault(requests[n].checkpoint_key, []).append(row)
    routing = [(key, torch.tensor(rs, device=device)) for key, rs in groups.items()]
    mine = [torch.tensor([row for row, o in enumerate(owners) if o == n], device=device) for n in range(len(requests))]
    stops = [backend._stop_ids(r.options) for r in requests]
    k_max = max(r.topk_logprobs for r in requests)
    tokens, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    top_ids, top_lps = [[] for _ in prompts], [[] for _ in prompts]
    reasons, alive = ["length"] * rows, [True] * rows
    cache = det.DecodeCache(rows, width + steps)
    with scope(cache), backend.lora.route(routing):
        logits = _prefill(backend, requests, mine, cache)
        for step in range(steps):
            chosen = torch.zeros(rows, dtype=torch.long, device=device)
            processed_lp = {}
            for n, r in enumerate(requests):
                picked, processed = choose(logits.index_select(0, mine[n]), r.options, generators[n])
                chosen[mine[n]] = picked
                if r.options.processed_logprobs:  # from the request's own rows: batch-invariant too
                    processed_lp[n] = processed.gather(-1, picked[:, None])[:, 0]
            reported = det.target_logprobs(logits, chosen[:, None])[:, 0]
            for n, values in processed_lp.items():
                reported[mine[n]] = values
            reported = reported.tolist()
            if k_max:
                top = logits.topk(k_max, dim=-1).indices
                top_values = det.target_logprobs(logits, top)
                top, top_values = top.tolist(), top_values.tolist()
            grew: dict[int, list[int]] = {}
            for row, tok in enumerate(chosen.tolist()):
                if not alive[row]:
                    continue
                r = requests[owners[row]]
                tokens[row].append(tok)
                logprobs[row].append(reported[row])
                if r.topk_logprobs:
                    top_ids[row].append(top[row][:r.topk_logprobs])
                    top_lps[row].append(top_values[row][:r.topk_logprobs])
                if tok in stops[owners[row]] or backend._hits_stop_string(tokens[row], r.options.stop_strings):
                    alive[row], reasons[row] = False, "stop"
                elif len(tokens[row]) >= r.options.max_tokens:
                    alive[row] = False
                if r.progress is not None:
                    grew.setdefault(owners[row], []).append(row)
            for n, grown in grew.items():
                topk = bool(requests[n].topk_logprobs)
                requests[n].progress([Piece(index[row], tokens[row][-1:], logprobs[row][-1:],
                                            None if alive[row] else reasons[row], top_ids[row][-1:] if topk else None,
                                            top_lps[row][-1:] if topk else None) for row in grown])
            if not any(alive):
                break
            logits = model(input_ids=chosen[:, None], position_ids=(lengths + step)[:, None]).logits[:, -1].float()
    decoded: list[list[GeneratedSequence]] = [[] for _ in requests]
    for row, n in enumerate(owners):
        topk = bool(requests[n].topk_logprobs)
        decoded[n].append(GeneratedSequence(tokens[row], logprobs[row], reasons[row],
                                            top_ids[row] if topk else None, top_lps[row] if topk else None))
    return decoded


def _prefill(backend, requests: list[SampleRequest], mine: list[torch.Tensor], cache: det.DecodeCache) -> torch.Tensor:
    """Each request's prompt through the decoder once, alone at its true length, its keys written to
    all of its sample rows (``cache.prefill``), then the prompts' last positions through the head
    together: (rows, vocab) float logits. A row's numbers do not depend on the pass's other rows, so
    this is the work of the prompts' tokens only (not rows x the longest prompt) for the same bits."""
    model, device = backend.loaded.model, backend.device
    last = []
    for n, r in enumerate(requests):
        ids = torch.from_numpy(r.prompt.astype(np.int64)).to(device)[None]
        with cache.prefill(mine[n]), backend.lora.route([(r.checkpoint_key, None)]):
            hidden = model.get_decoder()(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None],
                                         use_cache=False).last_hidden_state
        last.append(hidden[0, -1])
    keys: dict = {}
    for n, r in enumerate(requests):
        keys.setdefault(r.checkpoint_key, []).append(n)
    with backend.lora.route([(key, torch.tensor(ns, device=device)) for key, ns in keys.items()]):
        head = model.get_output_embeddings()(torch.stack(last)).float()     # (requests, vocab)
    owner = torch.empty(cache.rows, dtype=torch.long, device=device)
    for n, rows in enumerate(mine):
        owner[rows] = n
    return head.index_select(0, owner)
