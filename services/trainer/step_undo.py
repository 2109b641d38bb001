"""Undo of one optim step (engine.py): what the step changes, copied before it, put back when it
raises or leaves a weight or Adam moment that is not finite."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from temper.services.trainer.adapters import TrainedAdapter


class StepUndo:
    """What an optim step changes, copied before it (a LoRA adapter's: small beside a pass): weights,
    Adam state and hyperparameters, and the gradients when clipping will scale them."""

    def __init__(self, adapter: TrainedAdapter, copy_grads: bool):
        self.adapter, optimizer = adapter, adapter.optimizer
        self.params = list(adapter.params.values())
        self.weights = [p.detach().clone() for p in self.params]
        self.grads = [p.grad.clone() if copy_grads and p.grad is not None else p.grad for p in self.params]
        self.state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
                      for p in self.params if p in optimizer.state}
        self.groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]

    def all_finite(self) -> bool:
        state = self.adapter.optimizer.state
        tensors = self.params + [v for p in self.params for k, v in state.get(p, {}).items() if k != "step"]
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())  # one device sync

    def restore(self) -> None:
        optimizer = self.adapter.optimizer
        with torch.no_grad():
            for p, weights, grad in zip(self.params, self.weights, self.grads):
                p.copy_(weights)
                p.grad = grad
                if p in self.state:
                    optimizer.state[p] = self.state[p]
                else:
                    optimizer.state.pop(p, None)
        for group, saved in zip(optimizer.param_groups, self.groups):
            group.update(saved)
