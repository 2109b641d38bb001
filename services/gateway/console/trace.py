"""A session's timeline as Chrome trace-event JSON (what Perfetto UI and chrome://tracing open),
built from the rows the scheduler keeps (RunMetric, SamplingRecord).

Processes and tracks:
- "training runs": one track per run (more when its requests overlap: a track never holds two
  spans that cross). Each request is a span from received to answered holding two children,
  "queued" (received -> sent to its trainer) and "trainer <address> · cycle N" (sent -> answered),
  whose args say how many other runs shared the cycle.
- "trainers": one track per trainer address, a span per cycle that ran this session's work.
- "sampling": one track per sampling client (more when its calls overlap), a span per call.
- counters: queue depth (this session's requests waiting for a trainer), active sample requests,
  and tokens trained, sampled and prefilled, cumulative and per second.
Timestamps are unix microseconds (``ts``, ``dur``), so spans line up with logs and metrics.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

RUNS, TRAINERS, SAMPLING, COUNTERS = 1, 2, 3, 4
PROCESS_NAMES = {RUNS: "training runs", TRAINERS: "trainers", SAMPLING: "sampling", COUNTERS: "counters"}
MAX_RATE_BUCKETS = 200


def _us(ms: int) -> int:
    return int(ms) * 1000


class _Tracks:
    """Assigns spans to tracks so that no two spans on one track cross (greedy interval partitioning)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.ends: dict[str, list[int]] = defaultdict(list)  # name -> each track's last end
        self.tids: dict[tuple[str, int], int] = {}
        self.names: list[tuple[int, str]] = []

    def tid(self, name: str, start: int, end: int) -> int:
        lanes = self.ends[name]
        for i, last in enumerate(lanes):
            if last <= start:
                lanes[i] = end
                break
        else:
            lanes.append(end)
            i = len(lanes) - 1
        if (name, i) not in self.tids:
            self.tids[(name, i)] = len(self.tids) + 1
            self.names.append((self.tids[(name, i)], name if i == 0 else f"{name} #{i + 1}"))
        return self.tids[(name, i)]


def _span(name: str, cat: str, pid: int, tid: int, start_ms: int, end_ms: int, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start_ms),
            "dur": max(0, _us(end_ms) - _us(start_ms)), "args": args}


def _request_spans(run_rows: dict[str, list], tracks: _Tracks) -> list[dict]:
    events = []
    for run_id in sorted(run_rows):
        for r in sorted(run_rows[run_id], key=lambda r: (r.created_unix_ms, r.seq_id)):
            started = min(max(r.started_unix_ms or r.answered_unix_ms, r.created_unix_ms), r.answered_unix_ms)
            tid = tracks.tid(run_id, r.created_unix_ms, r.answered_unix_ms)
            args = {"training_run_id": run_id, "seq_id": r.seq_id, "kind": r.kind, "status": r.status,
                    "step": r.step, "num_tokens": r.num_tokens, "trainer": r.trainer, "cycle": r.cycle,
                    "cobatched_with": r.cobatched_with, "queued_seconds": r.queued_seconds,
                    "trainer_seconds": r.trainer_seconds}
            if r.HasField("loss"):
                args["loss"] = r.loss
            if r.error:
                args["error"] = r.error
            events.append(_span(f"{r.kind} #{r.seq_id}", "request", RUNS, tid, r.created_unix_ms, r.answered_unix_ms, args))
            events.append(_span("queued", "queued", RUNS, tid, r.created_unix_ms, started, {"seq_id": r.seq_id}))
            events.append(_span(f"trainer {r.trainer or '?'} · cycle {r.cycle}", "running", RUNS, tid, started,
                                r.answered_unix_ms, {"seq_id": r.seq_id, "trainer": r.trainer, "cycle": r.cycle,
                                                     "cobatched_with": r.cobatched_with}))
    return events


def _cycle_spans(run_rows: dict[str, list], tracks: _Tracks) -> list[dict]:
    cycles: dict[tuple[str, int], list] = defaultdict(list)
    for rows in run_rows.values():
        for r in rows:
            if r.trainer and r.started_unix_ms:
                cycles[(r.trainer, r.cycle)].append(r)
    events = []
    for (trainer, cycle), rows in sorted(cycles.items(), key=lambda kv: min(r.started_unix_ms for r in kv[1])):
        start, end = min(r.started_unix_ms for r in rows), max(r.answered_unix_ms for r in rows)
        tid = tracks.tid(trainer, start, end)
        events.append(_span(f"cycle {cycle}", "cycle", TRAINERS, tid, start, end, {
            "trainer": trainer, "cycle": cycle, "requests": len(rows),
            "cobatched_with": max(r.cobatched_with for r in rows), "num_tokens": sum(r.num_tokens for r in rows)}))
    return events


def _sampling_spans(records: Iterable, tracks: _Tracks) -> list[dict]:
    events = []
    for s in sorted(records, key=lambda s: (s.started_unix_ms, s.sampler_id)):
        tid = tracks.tid(s.sampler_id, s.started_unix_ms, s.answered_unix_ms)
        events.append(_span(f"{s.kind} ×{s.num_samples}" if s.num_samples else s.kind, "sampling", SAMPLING, tid,
                            s.started_unix_ms, s.answered_unix_ms,
                            {"sampler_id": s.sampler_id, "kind": s.kind, "num_samples": s.num_samples,
                             "prompt_tokens": s.prompt_tokens, "tokens_sampled": s.tokens_sampled}))
    return events


def _steps(changes: list[tuple[int, int]], name: str, series: str) -> list[dict]:
    """A counter from (time ms, delta) changes: its value after each instant's changes."""
    events, value = [], 0
    by_time: dict[int, int] = defaultdict(int)
    for at, delta in changes:
        by_time[at] += delta
    for at in sorted(by_time):
        value += by_time[at]
        events.append({"name": name, "ph": "C", "pid": COUNTERS, "ts": _us(at), "args": {series: value}})
    return events


def _rates(points: list[tuple[int, int]], start_ms: int, end_ms: int, name: str) -> list[dict]:
    """Tokens per second in equal buckets over [start, end) (a point counts where its request was answered)."""
    if not points or end_ms <= start_ms:
        return []
    width = max(1000, -(-(end_ms - start_ms) // MAX_RATE_BUCKETS))
    sums: dict[int, int] = defaultdict(int)
    for at, n in points:
        sums[(min(max(at, start_ms), end_ms - 1) - start_ms) // width] += n
    buckets = -(-(end_ms - start_ms) // width)
    return [{"name": name, "ph": "C", "pid": COUNTERS, "ts": _us(start_ms + i * width),
             "args": {"tokens/s": sums.get(i, 0) * 1000.0 / width}} for i in range(buckets)]


def _counters(run_rows: dict[str, list], records: list, start_ms: int, end_ms: int) -> list[dict]:
    rows = [r for rs in run_rows.values() for r in rs]
    queued = [(r.created_unix_ms, 1) for r in rows] + [(max(r.started_unix_ms or r.answered_unix_ms, r.created_unix_ms), -1)
                                                       for r in rows]
    active = [(s.started_unix_ms, 1) for s in records] + [(s.answered_unix_ms, -1) for s in records]
    trained = [(r.answered_unix_ms, r.num_tokens) for r in rows if r.kind == "forward_backward" and r.status == "done"]
    sampled = [(s.answered_unix_ms, s.tokens_sampled) for s in records]
    prefilled = [(s.answered_unix_ms, s.prompt_tokens) for s in records]
    events = _steps(queued, "queue depth", "requests") + _steps(active, "active sample requests", "requests")
    for label, points in (("tokens trained", trained), ("tokens sampled", sampled), ("tokens prefilled", prefilled)):
        events += _steps(points, label, "tokens")
        events += _rates(points, start_ms, end_ms, f"{label} per second")
    return events


def build_trace(session_id: str, run_rows: dict[str, list], records: list, start_ms: int, end_ms: int) -> dict:
    run_tracks, trainer_tracks, sampler_tracks = _Tracks(RUNS), _Tracks(TRAINERS), _Tracks(SAMPLING)
    spans = (_request_spans(run_rows, run_tracks) + _cycle_spans(run_rows, trainer_tracks)
             + _sampling_spans(records, sampler_tracks))
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}} for pid, name in PROCESS_NAMES.items()]
    meta += [{"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}} for pid in PROCESS_NAMES]
    for tracks in (run_tracks, trainer_tracks, sampler_tracks):
        meta += [{"name": "thread_name", "ph": "M", "pid": tracks.pid, "tid": tid, "args": {"name": name}}
                 for tid, name in tracks.names]
    return {"traceEvents": meta + spans + _counters(run_rows, records, start_ms, end_ms), "displayTimeUnit": "ms",
            "otherData": {"session_id": session_id, "from_unix_ms": start_ms, "to_unix_ms": end_ms,
                          "requests": sum(len(v) for v in run_rows.values()), "sampling_calls": len(records)}}
