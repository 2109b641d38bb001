"""The trainer's compute: forward/backward with a loss, Adam steps, checkpoint save/load.

Transport-free (no gRPC here) so tests drive it directly. Every public method validates its whole
input before it touches an adapter, gradient or optimizer state: a rejected call changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from temper.common.validation import DecodedDatum, validate_adam, validate_forward_backward
from temper.services.models.loading import LoadedModel
from temper.services.trainer.adapters import Adapter, AdapterHost
from temper.services.trainer.checkpoints import CheckpointStore
from temper.services.trainer.losses import LOSS_FNS
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import types_pb2


@dataclass
class PreparedForwardBackward:
    adapter: Adapter
    data: list[DecodedDatum]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool


@dataclass
class ForwardBackwardResult:
    logprobs: list[np.ndarray]          # per datum, float32 (N,)
    elementwise_loss: list[np.ndarray]  # per datum, float32 (N,)
    metrics: dict[str, float]


class TrainerEngine:
    def __init__(self, loaded: LoadedModel, settings: TrainerSettings):
        self.loaded = loaded
        self.settings = settings
        self.device = torch.device(settings.device)
        self.host = AdapterHost(loaded.model, loaded.name, settings.default_lora_alpha)
        self.store = CheckpointStore(settings.checkpoint_dir)
        # Models that post-process logits (e.g. soft-capping) take the plain full-logits path.
        self._plain_head = not getattr(loaded.model.config, "final_logit_softcapping", None)

    # ---- one scheduler cycle ------------------------------------------------------------------

    def prepare_forward_backward(self, item: types_pb2.ForwardBackwardItem) -> PreparedForwardBackward:
        adapter = self.host.get(item.adapter_id)
        data, config = validate_forward_backward(
            item.data, item.loss_fn, item.loss_fn_config, self.loaded.vocab_size, self.loaded.max_context_length
        )
        return PreparedForwardBackward(adapter, data, item.loss_fn, config, item.forward_only)

    def run_cycle(
        self, forward_backward: list[types_pb2.ForwardBackwardItem], optim_step: list[types_pb2.OptimStepItem]
    ) -> tuple[list[ForwardBackwardResult], list[dict[str, float]]]:
        prepared = [self.prepare_forward_backward(item) for item in forward_backward]
        steps = []
        for item in optim_step:
            validate_adam(item.adam_params)
            steps.append((self.host.get(item.adapter_id), item.adam_params))
        results = [self.forward_backward(p) for p in prepared]
        return results, [self.optim_step(adapter, params) for adapter, params in steps]

    def forward_backward(self, prepared: PreparedForwardBackward) -> ForwardBackwardResult:
        adapter = prepared.adapter
        model = self.host.activate(adapter)
        snapshot = None if prepared.forward_only else adapter.grads_snapshot()
        logprobs, losses, total = [], [], 0.0
        try:
            for batch in self._microbatches(prepared.data):
                with torch.set_grad_enabled(not prepared.forward_only):
                    lp, elementwise, mask = self._loss(model, batch, prepared.loss_fn, prepared.config)
                    loss = elementwise.sum()
                    if not prepared.forward_only:
                        loss.backward()
                total += float(loss.detach())
                for row, datum in enumerate(batch):
                    n = len(datum.tokens)
                    logprobs.append(lp[row, :n].detach().float().cpu().numpy())
                    losses.append(elementwise[row, :n].detach().float().cpu().numpy())
        except BaseException:
            if snapshot is not None:
                adapter.restore_grads(snapshot)  # an internal failure must not leave half a gradient
            raise
        ntokens = sum(len(d.tokens) for d in prepared.data)
        if not prepared.forward_only:
            adapter.pending_tokens += ntokens
        return ForwardBackwardResult(logprobs, losses, {"loss:sum": total, "num_tokens:sum": float(ntokens)})

    def optim_step(self, adapter: Adapter, params: types_pb2.AdamParams) -> dict[str, float]:
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
        weights = self.host.check_compatible(adapter, folder, with_optimizer)
        self.host.load(adapter, folder, weights, with_optimizer)

    # ---- numerics -----------------------------------------------------------------------------

    def _microbatches(self, data: list[DecodedDatum]):
        """Group datums (in order) so that rows × longest row stays under the token budget."""
        batch, longest = [], 0
        for datum in data:
            n = len(datum.tokens)
            if batch and max(longest, n) * (len(batch) + 1) > self.settings.max_tokens_per_microbatch:
                yield batch
                batch, longest = [], 0
            batch.append(datum)
            longest = max(longest, n)
        if batch:
            yield batch

    def _loss(self, model, batch: list[DecodedDatum], loss_fn: str, config: dict[str, float]):
        width = max(len(d.tokens) for d in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        inputs: dict[str, torch.Tensor] = {}
        for row, datum in enumerate(batch):
            n = len(datum.tokens)
            ids[row, :n] = torch.from_numpy(datum.tokens.astype(np.int64))
            mask[row, :n] = True
            for name, arr in datum.inputs.items():
                if name not in inputs:
                    inputs[name] = torch.zeros(len(batch), width, dtype=torch.long if arr.dtype.kind == "i" else torch.float32)
                inputs[name][row, :n] = torch.from_numpy(np.array(arr))
        ids, mask = ids.to(self.device), mask.to(self.device)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        lp = self._target_logprobs(model, ids, mask, inputs["target_tokens"])
        elementwise = LOSS_FNS[loss_fn](lp, inputs, config) * mask
        return lp, elementwise, mask

    def _target_logprobs(self, model, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) at every position, temperature 1, full vocabulary, shape (B, T).

        The lm_head + log-softmax runs over chunks of real (unpadded) positions, recomputed in the
        backward pass, so the B×T×V logits tensor never exists at once.
        """
        hf = self.host.base
        if not self._plain_head:
            logits = model(input_ids=ids, attention_mask=mask.long()).logits.float()
            return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
        hidden = hf.get_decoder()(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        head = hf.get_output_embeddings()
        flat_hidden, flat_targets = hidden[mask], targets[mask]
        chunk = self.settings.logprob_chunk_tokens
        pieces = []
        for start in range(0, flat_hidden.shape[0], chunk):
            h, t = flat_hidden[start : start + chunk], flat_targets[start : start + chunk]
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_head_logprobs, head, h, t, use_reentrant=False))
            else:
                pieces.append(_head_logprobs(head, h, t))
        out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        return out.masked_scatter(mask, torch.cat(pieces)) if pieces else out


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
