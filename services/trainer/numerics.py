"""The trainer's numerics: co-batched forward/backward passes of many LoRA adapters over one base model.

Pure computation on a ``LoraModel``: rows packed into micro-batches, log p(target) through the
decoder and a chunked lm_head, the losses applied per group, ``backward``. It holds no state and
knows nothing of runs, settings, adapter residency or protobuf, so it imports with torch, numpy and
``temper.services.lora`` only (the GPU benchmark loads it where grpc, protobuf and pydantic are
missing). Gradients accumulate into the adapters' parameters; undoing them on failure is the
caller's business.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from temper.services.lora.deterministic import deterministic
from temper.services.lora.model import LoraModel
from temper.services.trainer.deterministic_passes import deterministic_passes
from temper.services.trainer.losses import LOSS_FNS, loss_positions
from temper.services.trainer.memory import ActivationModel
from temper.services.trainer.pass_metrics import summed_metrics
from temper.services.trainer.logprob_pass import target_logprobs_pass
from temper.services.trainer.vision import ImageFeatures, pass_images


class TokenDatum(Protocol):
    """A decoded datum (``temper.common.validation.DecodedDatum`` is one)."""

    tokens: np.ndarray                  # int (N,)
    inputs: dict[str, np.ndarray]       # loss inputs: target_tokens (N,) or (N, K), the rest alike


@dataclass
class LossGroup:
    """The datums of one forward_backward item: one adapter, one loss."""

    adapter: str                        # LoraModel adapter key the rows are routed to
    data: Sequence[TokenDatum]
    loss_fn: str                        # a key of LOSS_FNS
    config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False
    # each datum in a pass of its own at its true length, batch-invariant primitives, gradients added
    # in datum order: its numbers do not depend on who shares the call (docs/deterministic.md)
    deterministic: bool = False


@dataclass
class ForwardBackwardResult:
    logprobs: list[np.ndarray]          # per datum, float32, shaped like its target_tokens
    elementwise_loss: list[np.ndarray]  # per datum, float32, same shape
    metrics: dict[str, float]           # loss:sum, num_tokens:sum, weights:sum (when weighted), <stat>:mean


@dataclass(frozen=True)
class PassOptions:
    max_tokens_per_microbatch: int = 4096   # rows x longest row, per pass; 0: no cap (memory decides)
    logprob_chunk_tokens: int = 1024        # tokens per lm_head + log-softmax chunk
    # Memory decides (plan_passes): with ``activations`` and ``activation_budget`` (bytes), passes are
    # split and checkpointed only as far as needed to fit the budget; ``checkpointing`` False never
    # checkpoints (micro-batches only). Without them, the token rule: checkpoint the decoder
    # (LoraModel.checkpoint_decoder_layers) in passes of at least ``checkpoint_min_tokens`` padded
    # tokens; None: never.
    checkpoint_min_tokens: int | None = None
    activations: ActivationModel | None = None
    activation_budget: int | None = None
    checkpointing: bool = True
    # A stored micro-batch smaller than this (when the pass is bigger) loses more to per-pass
    # overhead than checkpointing's recompute costs: then a bigger checkpointed one is taken.
    min_stored_microbatch_tokens: int = 512
    # Deterministic items' one-datum passes run this many at a time on as many threads, each pass on
    # one intra-op thread (the same bits as one at a time: deterministic_passes.py); 0: the process's
    # intra-op thread count; 1: one at a time on the calling thread.
    deterministic_workers: int = 0

    @property
    def memory_decides(self) -> bool:
        return self.activations is not None and self.activation_budget is not None

    def checkpoint_decoder(self, padded_tokens: int, width: int | None = None) -> bool:
        """Whether a single pass of ``padded_tokens`` (rows of ``width``) is checkpointed."""
        if self.memory_decides:
            if not self.checkpointing:
                return False
            width = width or padded_tokens
            return self.pass_bytes(padded_tokens, width, False) > self.activation_budget
        return self.checkpoint_min_tokens is not None and padded_tokens >= self.checkpoint_min_tokens

    def pass_bytes(self, padded_tokens: int, width: int, checkpointed: bool, image_tokens: int = 0,
                   trained_image_tokens: int = 0) -> float:
        return self.activations.pass_bytes(padded_tokens, width, checkpointed, self.logprob_chunk_tokens, image_tokens,
                                           trained_image_tokens)


@dataclass
class Row:
    group: int                # index of the LossGroup
    index: int                # datum index within the group
    datum: TokenDatum
    image_tokens: int = 0     # of its tokens, images' (the tower's memory: plan_passes)
    tower_trained: bool = False  # its images go through a tower its adapter trains, with gradients


PassHook = Callable[[bool, int, float], None]  # (gradients on, tokens, seconds), after each pass

CPU_LOGPROB_CHUNK_BYTES = 24 << 20


def default_logprob_chunk_tokens(device: torch.device, vocab_size: int) -> int:
    """On CPU, chunks whose float32 logits stay below glibc's 32 MiB mmap threshold: a bigger chunk is
    a fresh mmap, page-faulted and zeroed by the kernel, for every chunk of every pass (measured: a
    1024-token chunk made an 8 x 128-token pass 20-30% slower). Accelerators take big chunks."""
    if device.type != "cpu":
        return 1024
    return max(16, min(1024, CPU_LOGPROB_CHUNK_BYTES // (4 * vocab_size)))


def forward_backward(lora: LoraModel, groups: list[LossGroup], options: PassOptions, device: torch.device,
                     on_pass: PassHook | None = None, vision=None) -> list[ForwardBackwardResult]:
    """Every group's datums in shared passes (training groups with gradients, forward-only groups
    in no-grad passes); gradients accumulate into each group's own adapter. ``vision``: a
    vision-language model's ``images.VisionProcessor`` (its rows' images go through the tower once
    per call: ``vision.ImageFeatures``); None for a text-only model."""
    features = ImageFeatures(lora, vision) if vision is not None and lora.vision is not None else None
    logprobs = [[None] * len(g.data) for g in groups]
    losses = [[None] * len(g.data) for g in groups]
    totals = [0.0] * len(groups)
    stat_sums: list[dict[str, list[float]]] = [defaultdict(lambda: [0.0, 0.0]) for _ in groups]
    # Rows of one adapter side by side: the LoRA layers then work on views of the batch, not copies.
    adapter_rank = {key: n for n, key in enumerate(dict.fromkeys(g.adapter for g in groups))}
    with lora.stacking():  # stacked adapter weights built once for all passes; gradients handed back at the end
        _passes(lora, groups, options, device, on_pass, adapter_rank, logprobs, losses, totals, stat_sums, features)
    results = []
    for i, g in enumerate(groups):
        metrics = summed_metrics(g, totals[i])
        metrics.update({f"{name}:mean": total / max(count, 1.0) for name, (total, count) in stat_sums[i].items()})
        results.append(ForwardBackwardResult(logprobs[i], losses[i], metrics))
    return results


def _passes(lora, groups, options, device, on_pass, adapter_rank, logprobs, losses, totals, stat_sums, features) -> None:
    def record(grad, batch, lp, elementwise, stats, seconds):
        for r, row in enumerate(batch):
            n, shape = len(row.datum.tokens), row.datum.inputs["target_tokens"].shape
            cols = columns(row.datum.inputs["target_tokens"])
            logprobs[row.group][row.index] = lp[r, :n, :cols].detach().float().cpu().numpy().reshape(shape)
            losses[row.group][row.index] = elementwise[r, :n, :cols].detach().float().cpu().numpy().reshape(shape)
            totals[row.group] += float(losses[row.group][row.index].sum(dtype=np.float64))
        for i, group_stats in stats.items():
            for name, (total, count) in group_stats.items():
                stat_sums[i][name][0] += total
                stat_sums[i][name][1] += count
        if on_pass is not None:  # the .cpu() copies above waited for the device
            on_pass(grad, sum(len(row.datum.tokens) for row in batch), seconds)

    for grad in (True, False):
        rows = [Row(i, j, d, sum(image.tokens for image in getattr(d, "images", ())),
                    grad and bool(features is not None and lora.vision_targets(g.adapter)))
                for i, g in enumerate(groups) if g.forward_only != grad for j, d in enumerate(g.data)]
        rows.sort(key=lambda row: adapter_rank[groups[row.group].adapter])  # stable
        alone = [[row] for row in rows if groups[row.group].deterministic]
        shared = [row for row in rows if not groups[row.group].deterministic]
        workers = min(len(alone), options.deterministic_workers or torch.get_num_threads())
        planned = [*plan_passes(shared, options, grad), *(((batch, False) for batch in alone) if workers <= 1 else ())]
        for batch, checkpointed in planned:
            start = time.perf_counter()
            scope = deterministic(lora.model) if groups[batch[0].group].deterministic else contextlib.nullcontext()
            with torch.set_grad_enabled(grad), scope:
                lp, elementwise, stats = run_pass(lora, groups, batch, options, device, checkpointed, features)
                if grad:
                    elementwise.sum().backward()
            record(grad, batch, lp, elementwise, stats, time.perf_counter() - start)
        if workers > 1:
            deterministic_passes(lora.model, alone, grad, workers, lambda batch: run_pass(lora, groups, batch, options, device, False, features),
                                 lambda batch: _trained_params(lora, groups, batch), record)


def _trained_params(lora: LoraModel, groups: list[LossGroup], batch: list[Row]) -> list:
    """The parameters a one-run pass trains: its adapter's that require gradients (none: no adapter)."""
    adapter = lora.adapters.get(groups[batch[0].group].adapter)
    return [p for p in adapter.params.values() if p.requires_grad] if adapter is not None else []


def microbatches(rows: list[Row], max_tokens: int) -> Iterator[list[Row]]:
    """Group rows (in order) so that rows x longest row stays within ``max_tokens`` (0: no limit)."""
    yield from _greedy(rows, lambda n, width: not max_tokens or n * width <= max_tokens)


def plan_passes(rows: list[Row], options: PassOptions, grad: bool = True) -> Iterator[tuple[list[Row], bool]]:
    """The passes (rows in order, checkpoint the decoder?) that run ``rows``.

    Memory decides when ``options`` has an activation model and budget: the biggest micro-batches
    whose stored activations fit the budget, unless they would be small (under
    ``min_stored_microbatch_tokens`` while the rest is bigger) and checkpointed ones would hold more;
    what fits neither way runs one row at a time (checkpointed when allowed). No-grad passes keep no
    activations: only the token cap splits them. Without a memory model, the token rule of
    ``checkpoint_min_tokens`` on ``max_tokens_per_microbatch``-sized micro-batches."""
    cap = options.max_tokens_per_microbatch
    if not options.memory_decides or not grad:
        for batch in microbatches(rows, cap):
            padded = len(batch) * max(len(row.datum.tokens) for row in batch)
            yield batch, grad and not options.memory_decides and options.checkpoint_decoder(padded)
        return

    def fits(checkpointed: bool):
        return lambda n, width, images, trained: (not cap or n * width <= cap) and options.pass_bytes(
            n * width, width, checkpointed, images, trained) <= options.activation_budget

    at = 0
    while at < len(rows):
        rest = rows[at:]
        stored = _take(rest, fits(False))
        checkpointed = False
        batch = stored
        if options.checkpointing:
            small = _tokens(stored) < min(options.min_stored_microbatch_tokens, _tokens(rest))
            if not stored or small:
                ckpt = _take(rest, fits(True))
                if len(ckpt) > len(stored):
                    batch, checkpointed = ckpt, True
        if not batch:  # one row alone does not fit: run it anyway, as lean as allowed
            batch, checkpointed = rest[:1], options.checkpointing
        yield batch, checkpointed
        at += len(batch)


def _take(rows: list[Row], fits: Callable[[int, int, int, int], bool]) -> list[Row]:
    """The longest prefix of ``rows`` that ``fits(rows, longest row, image tokens, of them through a trained tower)``."""
    longest = images = trained = 0
    for n, row in enumerate(rows):
        longest = max(longest, len(row.datum.tokens))
        images += row.image_tokens
        trained += row.image_tokens if row.tower_trained else 0
        if not fits(n + 1, longest, images, trained):
            return rows[:n]
    return rows


def _tokens(rows: list[Row]) -> int:
    return len(rows) * max((len(row.datum.tokens) for row in rows), default=0)


def _greedy(rows: list[Row], fits: Callable[[int, int], bool]) -> Iterator[list[Row]]:
    batch, longest = [], 0
    for row in rows:
        n = len(row.datum.tokens)
        if batch and not fits(len(batch) + 1, max(longest, n)):
            yield batch
            batch, longest = [], 0
        batch.append(row)
        longest = max(longest, n)
    if batch:
        yield batch


def run_pass(lora: LoraModel, groups: list[LossGroup], batch: list[Row], options: PassOptions, device: torch.device,
             checkpointed: bool | None = None, features: ImageFeatures | None = None):
    """One micro-batch: target logprobs and elementwise loss, both (B, T, K), and per-group sums of
    each loss statistic with its token count (for ``name:mean`` metrics). ``checkpointed`` None:
    as ``options.checkpoint_decoder`` says for a pass this size. ``features``: the cycle's image work
    of a vision-language model (its rows, with images or not, get explicit multimodal positions)."""
    ids, mask, targets = pack_rows(batch, device)
    rows_of: dict[str, list[int]] = defaultdict(list)
    for r, row in enumerate(batch):
        rows_of[groups[row.group].adapter].append(r)
    routing = [(key, torch.tensor(rs, device=device)) for key, rs in rows_of.items()]
    if checkpointed is None:
        checkpointed = options.checkpoint_decoder(ids.numel(), ids.shape[1])
    images = pass_images(features, ids, mask, [(groups[row.group].adapter, _images(row)) for row in batch], checkpointed)
    lp = target_logprobs_pass(lora, ids, mask, targets, routing, options.logprob_chunk_tokens, checkpointed, images)
    elementwise, stats = apply_losses(lp, mask, groups, batch)
    return lp, elementwise, stats


def _images(row: Row) -> tuple:
    return getattr(row.datum, "images", ())


def pack_rows(batch: list[Row], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded token ids (B, T), their mask (B, T) and target tokens (B, T, K) on ``device``."""
    width = max(len(row.datum.tokens) for row in batch)
    k = max(columns(row.datum.inputs["target_tokens"]) for row in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    targets = torch.zeros(len(batch), width, k, dtype=torch.long)
    for r, row in enumerate(batch):
        n = len(row.datum.tokens)
        ids[r, :n] = torch.from_numpy(np.asarray(row.datum.tokens).astype(np.int64))
        mask[r, :n] = True
        tt = torch.tensor(row.datum.inputs["target_tokens"], dtype=torch.long)
        targets[r, :n, : columns(tt)] = tt.reshape(n, -1)
    return ids.to(device), mask.to(device), targets.to(device)


def apply_losses(lp: torch.Tensor, mask: torch.Tensor, groups: list[LossGroup], batch: list[Row]):
    """Each group's loss on its rows of ``lp`` (B, T, K): the elementwise loss (B, T, K), zero on
    padding, and per group {stat: (sum over the positions carrying loss, their count)}."""
    width, k = lp.shape[1], lp.shape[2]
    by_group: dict[int, list[int]] = defaultdict(list)
    for r, row in enumerate(batch):
        by_group[row.group].append(r)
    elementwise = torch.zeros_like(lp)
    stats: dict[int, dict[str, tuple[float, float]]] = {}
    for i, rs in by_group.items():
        group = groups[i]
        index = torch.tensor(rs, device=lp.device)
        ki = max(columns(batch[r].datum.inputs["target_tokens"]) for r in rs)
        inputs = {}
        # An optional input (gspo's sequence_ratio_mask) may come with some datums only: the rows
        # without it are NaN, which the loss reads as "absent" (validation refuses NaN values).
        names = dict.fromkeys(name for r in rs for name in batch[r].datum.inputs if name != "target_tokens")
        for name in names:
            values = torch.zeros(len(rs), width, ki, dtype=torch.float32)
            for j, r in enumerate(rs):
                given = batch[r].datum.inputs.get(name)
                if given is None:
                    values[j] = float("nan")
                    continue
                arr = torch.tensor(given, dtype=torch.float32)
                values[j, : arr.shape[0], : columns(arr)] = arr.reshape(arr.shape[0], -1)
            inputs[name] = values.to(lp.device)
        group_lp = lp.index_select(0, index)[:, :, :ki]
        valid = mask.index_select(0, index)[:, :, None].expand_as(group_lp)
        if ki == 1:  # per-token losses see (B, T) tensors
            flat = {n: v[..., 0] for n, v in inputs.items()}
            loss, extra = LOSS_FNS[group.loss_fn](group_lp[..., 0], flat, group.config)
            loss, extra = loss[..., None], {n: v[..., None] for n, v in extra.items()}
            carrying = loss_positions(flat)[..., None]
        else:
            loss, extra = LOSS_FNS[group.loss_fn](group_lp, inputs, group.config)
            carrying = loss_positions(inputs)
        loss = loss * valid
        padded = torch.zeros(len(rs), width, k, dtype=loss.dtype, device=loss.device)
        padded[:, :, :ki] = loss
        elementwise = elementwise.index_add(0, index, padded)
        # Statistics average over the positions that carry loss, not over prompt targets (whose
        # sampler logprob 0 would pull ratio:mean far below 1 on an on-policy batch).
        counted = valid & carrying
        stats[i] = {name: (float(torch.where(counted, v, torch.zeros_like(v)).sum()), float(counted.sum()))
                    for name, v in extra.items()}
    return elementwise, stats


def columns(arr) -> int:
    return 1 if arr.ndim == 1 else int(arr.shape[1])
