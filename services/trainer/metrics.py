"""Prometheus series of the trainer process (default registry; served by common.metrics.serve_metrics)."""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)

CYCLE_SECONDS = Histogram("temper_trainer_cycle_seconds", "Wall time of one RunCycle (all passes and optim steps).",
                          buckets=_SECONDS)
PASS_SECONDS = Histogram("temper_trainer_pass_seconds", "Wall time of one micro-batch pass over the base model.",
                         ["kind"], buckets=_SECONDS)  # kind: forward_backward | forward
TOKENS_TRAINED = Counter("temper_trainer_tokens_trained", "Tokens of forward_backward items that accumulated gradients.")
TOKENS_FORWARD = Counter("temper_trainer_tokens_forward", "Tokens of forward-only items.")
CYCLES = Counter("temper_trainer_cycles", "RunCycle calls that completed.")
OPTIM_STEPS = Counter("temper_trainer_optim_steps", "Optimizer steps applied.")
RESIDENT_ADAPTERS = Gauge("temper_trainer_resident_adapters", "Adapters live in the model.")
OFFLOADED_ADAPTERS = Gauge("temper_trainer_offloaded_adapters", "Adapters offloaded to host memory or disk.")
# Failed RPCs are counted by the error interceptor, as every service's: temper_rpc_errors_total (common/metrics.py).
REFUSED_ITEMS = Counter("temper_trainer_refused_items", "RunCycle items refused (answered in the response while the "
                        "cycle's other items ran), by gRPC status code.", ["code"])
RSS_BYTES = Gauge("temper_trainer_rss_bytes", "Resident set size of the trainer process.")
CUDA_ALLOCATED_BYTES = Gauge("temper_trainer_cuda_memory_allocated_bytes",
                             "torch.cuda.memory_allocated() of the current device (0 unless CUDA is in use).")


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return float("nan")


def _cuda_allocated() -> float:
    import torch

    return float(torch.cuda.memory_allocated()) if torch.cuda.is_initialized() else 0.0


# read at scrape time: the values belong to the process, not to one engine
RSS_BYTES.set_function(_rss_bytes)
CUDA_ALLOCATED_BYTES.set_function(_cuda_allocated)


def adapters_changed(resident: int, offloaded: int) -> None:
    RESIDENT_ADAPTERS.set(resident)
    OFFLOADED_ADAPTERS.set(offloaded)
