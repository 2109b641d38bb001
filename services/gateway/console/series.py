"""Session Metrics: a session's time series in equal buckets over a range, from its kept rows.

- active sample requests: the average number of its sampling calls in flight over the bucket;
- trainer busy fraction: the share of the bucket during which a trainer was running any of the
  session's training requests (the union of their sent -> answered intervals);
- tokens per second trained (forward_backward tokens, where answered), sampled and prefilled
  (where the sampling call was answered).
"""

from __future__ import annotations

MAX_BUCKETS = 300


def _width(start_ms: int, end_ms: int, buckets: int) -> int:
    return max(1000, -(-(end_ms - start_ms) // buckets))


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _spread(intervals: list[tuple[int, int]], edges: list[tuple[int, int]], start_ms: int, width: int) -> list[int]:
    """Each bucket's milliseconds covered by the intervals (counted once per interval)."""
    covered = [0] * len(edges)
    for lo, hi in intervals:
        first, last = max(0, (lo - start_ms) // width), min(len(edges) - 1, (hi - start_ms) // width)
        for i in range(first, last + 1):
            covered[i] += _overlap(lo, hi, *edges[i])
    return covered


def session_series(run_rows: dict[str, list], records: list, start_ms: int, end_ms: int,
                   buckets: int = MAX_BUCKETS) -> dict:
    width = _width(start_ms, end_ms, min(buckets, MAX_BUCKETS))
    n = -(-(end_ms - start_ms) // width)
    edges = [(start_ms + i * width, min(end_ms, start_ms + (i + 1) * width)) for i in range(n)]
    rows = [r for rs in run_rows.values() for r in rs]
    busy = _union([(r.started_unix_ms, r.answered_unix_ms) for r in rows if r.started_unix_ms])
    out = {"bucket_seconds": width / 1000.0, "t": [], "active_sample_requests": [], "trainer_busy_fraction": [],
           "tokens_trained_per_s": [], "tokens_sampled_per_s": [], "tokens_prefilled_per_s": []}

    def index(at_ms: int) -> int | None:
        return (at_ms - start_ms) // width if start_ms <= at_ms < end_ms else None

    trained, sampled, prefilled = [0] * n, [0] * n, [0] * n
    for r in rows:
        i = index(r.answered_unix_ms)
        if i is not None and r.kind == "forward_backward" and r.status == "done":
            trained[i] += r.num_tokens
    for s in records:
        i = index(s.answered_unix_ms)
        if i is not None:
            sampled[i] += s.tokens_sampled
            prefilled[i] += s.prompt_tokens
    active = _spread([(s.started_unix_ms, s.answered_unix_ms) for s in records], edges, start_ms, width)
    running = _spread(busy, edges, start_ms, width)
    for i, (b0, b1) in enumerate(edges):
        length = b1 - b0
        out["t"].append(b0 / 1000.0)
        out["active_sample_requests"].append(active[i] / length)
        out["trainer_busy_fraction"].append(running[i] / length)
        for key, counts in (("tokens_trained_per_s", trained), ("tokens_sampled_per_s", sampled),
                            ("tokens_prefilled_per_s", prefilled)):
            out[key].append(counts[i] * 1000.0 / length)
    return out
