"""Deterministic items' one-datum passes, several at a time on worker threads, with the same bits as
one at a time on the calling thread (docs/deterministic.md; tests/engine/test_deterministic.py).

Each pass is on one intra-op thread whatever runs beside it (``deterministic.on_this_thread``; routing,
the checkpointing switch, grad mode and the primitives' state are per thread) and computes its
adapter's gradients with ``torch.autograd.grad`` (the sums ``backward`` would hand the parameters'
AccumulateGrad). They are added to ``.grad`` on the calling thread in datum order, as ``backward``
would: the first onto an absent ``.grad`` taken as is (in the parameter's layout), the next added in
place. Results are recorded in datum order too."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import wait as futures_wait
from typing import Callable

import torch

from temper.services.lora.deterministic import deterministic, on_this_thread, worker_pool


def deterministic_passes(model, batches: list, grad: bool, workers: int, run: Callable, params_of: Callable,
                         record: Callable) -> None:
    """``batches`` (one-datum passes of ``model``), ``workers`` at a time: ``run(batch)`` -> (logprobs,
    elementwise losses, stats); ``params_of(batch)``: the parameters its gradients go to;
    ``record(grad, batch, lp, elementwise, stats, seconds)`` once per pass, in order."""
    pool = worker_pool(workers)
    pending: deque = deque()
    todo = iter(batches)

    def submit():
        batch = next(todo, None)
        if batch is not None:
            pending.append((batch, pool.submit(_one_pass, batch, grad, run, params_of)))

    # the model's attention switch and the process's one thread, held while the workers run
    with deterministic(model):
        try:
            for _ in range(2 * workers):  # a worker finishing out of turn starts the next pass at once
                submit()
            while pending:
                batch, future = pending.popleft()
                lp, elementwise, stats, params, grads, seconds = future.result()
                submit()
                if grad:
                    _accumulate(params, grads)
                record(grad, batch, lp, elementwise, stats, seconds)
        finally:  # on a failure, no pass may still run when the scope restores the thread count
            for _, future in pending:
                future.cancel()
            futures_wait([future for _, future in pending])


def _accumulate(params: list, grads) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
            else:
                p.grad += g


def _one_pass(batch, grad: bool, run: Callable, params_of: Callable):
    start = time.perf_counter()
    with on_this_thread(), torch.set_grad_enabled(grad):
        lp, elementwise, stats = run(batch)
        params, grads = [], ()
        if grad:
            params = params_of(batch)
            if params:
                grads = torch.autograd.grad(elementwise.sum(), params, allow_unused=True)
            else:
                elementwise.sum().backward()  # no adapter parameter: whatever backward says of it
    return lp, elementwise, stats, params, grads, time.perf_counter() - start
