"""The trainer's compute: co-batched forward/backward for many adapters, Adam steps, checkpoints.

Transport-free (no gRPC here) so tests drive it directly. Every public method validates its whole
input before it touches an adapter, gradient or optimizer state: a rejected call changes nothing.

One cycle packs the datums of every forward_backward item (each item belongs to one adapter)
into shared passes over the base model; each row is routed to its own adapter, so gradients
land only where they belong. Forward-only items run in their own no-grad passes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from temper.common.errors import FailedPrecondition
from temper.common.validation import DecodedDatum, validate_adam, validate_forward_backward
from temper.services.lora.model import LoraModel
from temper.services.models.loading import LoadedModel
from temper.services.trainer.adapters import AdapterHost, TrainedAdapter
from temper.services.trainer.checkpoints import CheckpointStore
from temper.services.trainer.losses import LOSS_FNS
from temper.services.trainer.settings import TrainerSettings
from temper.services.trainer.target_logprobs import target_logprobs
from temper.v1 import types_pb2


@dataclass
class PreparedForwardBackward:
    adapter: TrainedAdapter
    data: list[DecodedDatum]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool


@dataclass
class ForwardBackwardResult:
    logprobs: list[np.ndarray]          # per datum, float32 (N,)
    elementwise_loss: list[np.ndarray]  # per datum, float32 (N,)
    metrics: dict[str, float]


@dataclass
class Row:
    item: int                 # index of the forward_backward item
    index: int                # datum index within the item
    datum: DecodedDatum


ANSWERS_KEPT = 16  # per adapter: a re-sent cycle is one cycle's worth of a run's items


class TrainerEngine:
    def __init__(self, loaded: LoadedModel, settings: TrainerSettings):
        self.loaded = loaded
        self.settings = settings
        self.device = torch.device(settings.device)
        self.lora = LoraModel(loaded.model, loaded.name)
        offload_to = settings.offload_to if settings.offload_to != "auto" else ("disk" if self.device.type == "cpu" else "host")
        self.host = AdapterHost(self.lora, settings.default_lora_alpha, settings.max_resident_adapters, settings.offload_dir,
                                offload_to)
        self.store = CheckpointStore(settings.checkpoint_dir)
        if settings.activation_checkpointing:
            self.lora.checkpoint_decoder_layers()
        # Models that post-process logits (e.g. soft-capping) take the plain full-logits path.
        self._plain_head = not getattr(loaded.model.config, "final_logit_softcapping", None)
        self.logprob_chunk_tokens = settings.logprob_chunk_tokens or default_logprob_chunk_tokens(self.device, loaded.vocab_size)

    # ---- one scheduler cycle ------------------------------------------------------------------

    def prepare_forward_backward(self, item: types_pb2.ForwardBackwardItem) -> PreparedForwardBackward:
        adapter = self.host.get(item.training_run_id)
        data, config = validate_forward_backward(
            item.data, item.loss_fn, item.loss_fn_config, self.loaded.vocab_size, self.loaded.max_context_length
        )
        return PreparedForwardBackward(adapter, data, item.loss_fn, config, item.forward_only)

    def run_cycle(
        self, forward_backward: list[types_pb2.ForwardBackwardItem], optim_step: list[types_pb2.OptimStepItem]
    ) -> tuple[list[ForwardBackwardResult], list[dict[str, float]]]:
        """Every item's answer, in order. Items whose seq the adapter has already applied are answered
        from memory; the rest run (all passes, then the optim steps)."""
        with self.host.pinned([i.training_run_id for i in forward_backward] + [i.training_run_id for i in optim_step]):
            # earlier answers first: a seq applied so long ago that its answer is gone fails the cycle untouched
            results: list = [self._earlier_answer(item) if self._applied(item) else None for item in forward_backward]
            metrics: list = [self._earlier_answer(item) if self._applied(item) else None for item in optim_step]
            fresh_fb = [i for i, answer in enumerate(results) if answer is None]
            fresh_steps = [i for i, answer in enumerate(metrics) if answer is None]
            prepared = [self.prepare_forward_backward(forward_backward[i]) for i in fresh_fb]
            steps = []
            for i in fresh_steps:
                validate_adam(optim_step[i].adam_params)
                steps.append((self.host.get(optim_step[i].training_run_id), optim_step[i].adam_params))
            for i, result in zip(fresh_fb, self.forward_backward(prepared)):
                results[i] = result
            for i, (adapter, params) in zip(fresh_steps, steps):
                metrics[i] = self.optim_step(adapter, params)
            for item, answer in [*zip(forward_backward, results), *zip(optim_step, metrics)]:
                if item.seq_id:
                    self.host.get(item.training_run_id).remember(item.seq_id, answer, ANSWERS_KEPT)
            return results, metrics

    def _applied(self, item) -> bool:
        return bool(item.seq_id) and item.seq_id <= self.host.get(item.training_run_id).applied_seq

    def _earlier_answer(self, item):
        answer = self.host.get(item.training_run_id).answers.get(item.seq_id)
        if answer is None:
            raise FailedPrecondition(f"seq {item.seq_id} of {item.training_run_id} was already applied and its answer is no "
                                     f"longer held")
        return answer

    def forward_backward(self, items: list[PreparedForwardBackward]) -> list[ForwardBackwardResult]:
        """All items in shared passes; gradients accumulate into each item's own adapter."""
        logprobs = [[None] * len(p.data) for p in items]
        losses = [[None] * len(p.data) for p in items]
        totals = [0.0] * len(items)
        stat_sums: list[dict[str, list[float]]] = [defaultdict(lambda: [0.0, 0.0]) for _ in items]
        training = {p.adapter.adapter_id: p.adapter for p in items if not p.forward_only}
        snapshots = {key: adapter.grads_snapshot() for key, adapter in training.items()}
        # Rows of one adapter side by side: the LoRA layers then work on views of the batch, not copies.
        adapter_rank = {key: n for n, key in enumerate(dict.fromkeys(p.adapter.adapter_id for p in items))}
        try:
            for grad in (True, False):
                rows = [Row(i, j, d) for i, p in enumerate(items) if p.forward_only != grad for j, d in enumerate(p.data)]
                rows.sort(key=lambda row: adapter_rank[items[row.item].adapter.adapter_id])  # stable
                for batch in self._microbatches(rows):
                    with torch.set_grad_enabled(grad):
                        lp, elementwise, stats = self._pass(items, batch)
                        loss = elementwise.sum()
                        if grad:
                            loss.backward()
                    for r, row in enumerate(batch):
                        n, shape = len(row.datum.tokens), row.datum.inputs["target_tokens"].shape
                        cols = _columns(row.datum.inputs["target_tokens"])
                        logprobs[row.item][row.index] = lp[r, :n, :cols].detach().float().cpu().numpy().reshape(shape)
                        losses[row.item][row.index] = elementwise[r, :n, :cols].detach().float().cpu().numpy().reshape(shape)
                        totals[row.item] += float(losses[row.item][row.index].sum(dtype=np.float64))
                    for i, item_stats in stats.items():
                        for name, (total, count) in item_stats.items():
                            stat_sums[i][name][0] += total
                            stat_sums[i][name][1] += count
        except BaseException:
            for key, adapter in training.items():
                adapter.restore_grads(snapshots[key])  # an internal failure must not leave half a gradient
            raise
        results = []
        for i, p in enumerate(items):
            ntokens = sum(len(d.tokens) for d in p.data)
            if not p.forward_only:
                p.adapter.pending_tokens += ntokens
            metrics = {"loss:sum": totals[i], "num_tokens:sum": float(ntokens)}
            metrics.update({f"{name}:mean": total / max(count, 1.0) for name, (total, count) in stat_sums[i].items()})
            results.append(ForwardBackwardResult(logprobs[i], losses[i], metrics))
        return results

    def optim_step(self, adapter: TrainedAdapter, params: types_pb2.AdamParams) -> dict[str, float]:
        grads = [p for p in adapter.params.values() if p.grad is not None]
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        for group in adapter.optimizer.param_groups:
            group.update(
                lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps, weight_decay=params.weight_decay
            )
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        tokens, adapter.pending_tokens = adapter.pending_tokens, 0
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": params.learning_rate, "step:max": float(adapter.steps),
                "num_tokens:sum": float(tokens)}

    # ---- checkpoints --------------------------------------------------------------------------

    def save(self, adapter_id: str, key: str, include_optimizer: bool) -> int:
        adapter = self.host.get(adapter_id)
        staging = self.store.staging_dir(key)
        try:
            self.host.save(adapter, staging, include_optimizer)
            return self.store.publish(staging, key)
        except BaseException:
            self.store.discard(staging)
            raise

    def load(self, adapter_id: str, key: str, with_optimizer: bool) -> None:
        adapter = self.host.get(adapter_id)
        folder = self.store.existing(key)
        weights = self.host.read_checkpoint(adapter, folder, with_optimizer)
        self.host.load(adapter, folder, weights, with_optimizer)

    # ---- numerics -----------------------------------------------------------------------------

    def _microbatches(self, rows: list[Row]):
        """Group rows (in order) so that rows × longest row stays under the token budget."""
        batch, longest = [], 0
        for row in rows:
            n = len(row.datum.tokens)
            if batch and max(longest, n) * (len(batch) + 1) > self.settings.max_tokens_per_microbatch:
                yield batch
                batch, longest = [], 0
            batch.append(row)
            longest = max(longest, n)
        if batch:
            yield batch

    def _pass(self, items: list[PreparedForwardBackward], batch: list[Row]):
        """One micro-batch: target logprobs and elementwise loss, both (B, T, K), and per-item sums
        of each loss statistic with its token count (for ``name:mean`` metrics)."""
        width = max(len(row.datum.tokens) for row in batch)
        k = max(_columns(row.datum.inputs["target_tokens"]) for row in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        targets = torch.zeros(len(batch), width, k, dtype=torch.long)
        for r, row in enumerate(batch):
            n = len(row.datum.tokens)
            ids[r, :n] = torch.from_numpy(row.datum.tokens.astype(np.int64))
            mask[r, :n] = True
            tt = torch.tensor(row.datum.inputs["target_tokens"], dtype=torch.long)
            targets[r, :n, : _columns(tt)] = tt.reshape(n, -1)
        ids, mask, targets = ids.to(self.device), mask.to(self.device), targets.to(self.device)
        rows_of: dict[str, list[int]] = defaultdict(list)
        by_item: dict[int, list[int]] = defaultdict(list)
        for r, row in enumerate(batch):
            rows_of[items[row.item].adapter.adapter_id].append(r)
            by_item[row.item].append(r)
        groups = [(key, torch.tensor(rs, device=self.device)) for key, rs in rows_of.items()]
        lp = self._target_logprobs(ids, mask, targets, groups)

        elementwise = torch.zeros_like(lp)
        stats: dict[int, dict[str, tuple[float, float]]] = {}
        for i, rs in by_item.items():
            item = items[i]
            index = torch.tensor(rs, device=self.device)
            ki = max(_columns(batch[r].datum.inputs["target_tokens"]) for r in rs)
            inputs = {}
            for name in item.data[0].inputs:
                if name == "target_tokens":
                    continue
                values = torch.zeros(len(rs), width, ki, dtype=torch.float32)
                for j, r in enumerate(rs):
                    arr = torch.tensor(batch[r].datum.inputs[name], dtype=torch.float32)
                    values[j, : arr.shape[0], : _columns(arr)] = arr.reshape(arr.shape[0], -1)
                inputs[name] = values.to(self.device)
            item_lp = lp.index_select(0, index)[:, :, :ki]
            valid = mask.index_select(0, index)[:, :, None].expand_as(item_lp)
            if ki == 1:  # per-token losses see (B, T) tensors
                loss, extra = LOSS_FNS[item.loss_fn](item_lp[..., 0], {n: v[..., 0] for n, v in inputs.items()}, item.config)
                loss, extra = loss[..., None], {n: v[..., None] for n, v in extra.items()}
            else:
                loss, extra = LOSS_FNS[item.loss_fn](item_lp, inputs, item.config)
            loss = loss * valid
            padded = torch.zeros(len(rs), width, k, dtype=loss.dtype, device=loss.device)
            padded[:, :, :ki] = loss
            elementwise = elementwise.index_add(0, index, padded)
            stats[i] = {name: (float((v * valid).sum()), float(valid.sum())) for name, v in extra.items()}
        return lp, elementwise, stats

    def _checkpoint(self, ids: torch.Tensor) -> bool:
        """Checkpoint the decoder for big passes only: activation memory grows with the tokens, and
        for a small pass the recompute (about a third more compute) buys nothing."""
        return self.settings.activation_checkpointing and ids.numel() >= self.settings.activation_checkpointing_min_tokens

    def _target_logprobs(self, ids, mask, targets, groups) -> torch.Tensor:
        """log p(target) at every position and target column, temperature 1, full vocabulary, (B, T, K).

        The lm_head + log-softmax runs over chunks of real (unpadded) positions, recomputed in the
        backward pass, so the B×T×V logits tensor never exists at once.
        """
        model = self.loaded.model
        if not self._plain_head:
            with self.lora.route(groups), self.lora.checkpointing_enabled(self._checkpoint(ids)):
                logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits.float()
            return logits.log_softmax(-1).gather(-1, targets) * mask[..., None]
        with self.lora.route(groups), self.lora.checkpointing_enabled(self._checkpoint(ids)):
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask.long(), use_cache=False).last_hidden_state
        head = model.get_output_embeddings()
        flat_hidden, flat_targets = hidden[mask], targets[mask]
        # the adapter of every real token, for the head's routing
        token_rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)[mask]
        token_groups = [(key, torch.isin(token_rows, rows).nonzero().squeeze(-1)) for key, rows in groups]
        chunk = self.logprob_chunk_tokens
        pieces = []
        for start in range(0, flat_hidden.shape[0], chunk):
            stop = start + chunk
            local = [(k, t[(t >= start) & (t < stop)] - start) for k, t in token_groups]
            args = (self.lora, head, flat_hidden[start:stop], flat_targets[start:stop], [(k, t) for k, t in local if t.numel()])
            pieces.append(checkpoint(_head_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled() else _head_logprobs(*args))
        out = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
        return out.masked_scatter(mask[..., None].expand_as(targets), torch.cat(pieces)) if pieces else out


CPU_LOGPROB_CHUNK_BYTES = 24 << 20


def default_logprob_chunk_tokens(device: torch.device, vocab_size: int) -> int:
    """On CPU, chunks whose float32 logits stay below glibc's 32 MiB mmap threshold: a bigger chunk is
    a fresh mmap, page-faulted and zeroed by the kernel, for every chunk of every pass (measured: a
    1024-token chunk made an 8 x 128-token pass 20-30% slower). Accelerators take big chunks."""
    if device.type != "cpu":
        return 1024
    return max(16, min(1024, CPU_LOGPROB_CHUNK_BYTES // (4 * vocab_size)))


def _columns(arr) -> int:
    return 1 if arr.ndim == 1 else int(arr.shape[1])


def _head_logprobs(lora: LoraModel, head, hidden: torch.Tensor, targets: torch.Tensor, groups) -> torch.Tensor:
    # Routing is set inside so the backward-pass recomputation routes the same way.
    with lora.route(groups):
        logits = head(hidden).float()
    return target_logprobs(logits, targets)
