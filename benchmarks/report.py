"""How the co-batching benchmarks turn timed samples into ratios and print them against their goals:
medians, per-repetition spreads, goal verdicts and one stderr line per ratio (multitenant.py, moe.py,
vlm.py, gpu_multitenant.py). Standard library only, so the GPU script can take it to a bare box. The
scripts import it as ``report``: run as scripts, their own folder is first on ``sys.path``."""

from __future__ import annotations

import statistics
import sys
from typing import Mapping, TextIO

Goal = tuple[str, float]  # ("<=" or ">=", value)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: list[float]) -> dict:
    """min, quartiles, max and the values themselves: how far per-repetition ratios scatter."""
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"min": min(xs), "q1": q[0], "median": median(xs), "q3": q[2], "max": max(xs), "per_rep": xs}


def goal_met(goal: Goal, value: float | None) -> bool | None:
    """None when there is no value (a variant that was not run)."""
    if value is None:
        return None
    op, bound = goal
    return value <= bound if op == "<=" else value >= bound


def cobatch_ratios(cobatched: list[float], single: list[float], sliced: list[float]) -> tuple[dict, dict]:
    """(ratios of medians, per-repetition ratios) for co-batched ÷ one adapter on the same tokens
    (``cobatch_overhead``) and time-sliced ÷ co-batched (``cobatch_gain``). Sample i of each list
    comes from repetition i, whose variants ran side by side, so per-repetition ratios are paired."""
    ratios = {"cobatch_overhead": median(cobatched) / median(single), "cobatch_gain": median(sliced) / median(cobatched)}
    per_rep = {"cobatch_overhead": [c / s for c, s in zip(cobatched, single)],
               "cobatch_gain": [t / c for t, c in zip(sliced, cobatched)]}
    return ratios, per_rep


def goal_text(goal: Goal | str) -> str:
    if isinstance(goal, str):
        return goal
    op, bound = goal
    return f"{op} {bound:g}"


def verdict_text(met: bool | Mapping[str, bool]) -> str:
    """'met' / 'MISSED', or for several readings of one ratio 'wall met, CPU time MISSED'."""
    if isinstance(met, Mapping):
        return ", ".join(f"{k} {verdict_text(v)}" for k, v in met.items())
    return "met" if met else "MISSED"


def print_ratios(ratios: Mapping[str, float | None], goals: Mapping[str, Goal | str],
                 met: Mapping[str, bool | Mapping[str, bool]], *, width: int = 20,
                 details: Mapping[str, str] | None = None, file: TextIO | None = None) -> None:
    """One line per ratio that has a value: ``name  value (details)  (goal <= 1.1: met)``."""
    out = file if file is not None else sys.stderr
    for name, value in ratios.items():
        if value is None:
            continue
        detail = f" ({details[name]})" if details and name in details else ""
        print(f"{name:{width}s} {value:6.3f}{detail}  (goal {goal_text(goals[name])}: {verdict_text(met[name])})",
              file=out)
