"""The Perfetto export (services/gateway/console/trace.py) and Session Metrics (series.py) built from
kept rows: every span checked against the rows it came from (nesting, order, durations), counters
against the rows' intervals, series against sums computed here."""

import json
from collections import defaultdict

import pytest

from temper.services.gateway.console.series import session_series
from temper.services.gateway.console.trace import COUNTERS, RUNS, SAMPLING, TRAINERS, build_trace
from temper.v1 import records_pb2

T0 = 1_700_000_000_000


def metric(seq, created, started, answered, kind="forward_backward", trainer="127.0.0.1:7001", cycle=1, cobatched=0,
           tokens=10, status="done", loss=1.5):
    row = records_pb2.RunMetric(seq_id=seq, step=seq // 2, kind=kind, status=status, num_tokens=tokens,
                                trainer=trainer if started else "", cycle=cycle, cobatched_with=cobatched,
                                created_unix_ms=T0 + created, started_unix_ms=T0 + started if started is not None else 0,
                                answered_unix_ms=T0 + answered, queued_seconds=((started or answered) - created) / 1000,
                                trainer_seconds=(answered - (started or answered)) / 1000)
    if loss is not None and kind == "forward_backward":
        row.loss = loss
    return row


def sample(sampler, started, answered, prompt=5, sampled=7):
    return records_pb2.SamplingRecord(sampler_id=sampler, kind="sample", num_samples=2, prompt_tokens=prompt,
                                      tokens_sampled=sampled, started_unix_ms=T0 + started, answered_unix_ms=T0 + answered)


@pytest.fixture
def rows():
    # run a: seq 2 is queued while seq 1 runs (overlap); seq 3 failed before reaching a trainer
    a = [metric(1, 0, 100, 400, cycle=1, cobatched=1), metric(2, 50, 400, 700, kind="optim_step", cycle=2, loss=None),
         metric(3, 800, None, 820, status="failed", loss=None)]
    b = [metric(1, 20, 100, 390, cycle=1, cobatched=1, tokens=30)]
    return {"s:train:0": a, "s:train:1": b}


@pytest.fixture
def records():
    return [sample("s:sample:0", 0, 300), sample("s:sample:0", 100, 200), sample("s:sample:1", 500, 900)]


def spans(trace, cat=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and (cat is None or e["cat"] == cat)]


def test_every_request_row_is_one_span_with_its_queued_and_running_children(rows, records):
    trace = build_trace("s", rows, records, T0, T0 + 1000)
    requests = spans(trace, "request")
    assert len(requests) == sum(len(v) for v in rows.values())
    for run_id, run_rows in rows.items():
        for r in run_rows:
            [span] = [s for s in requests if s["args"]["training_run_id"] == run_id and s["args"]["seq_id"] == r.seq_id]
            assert span["pid"] == RUNS
            assert span["ts"] == r.created_unix_ms * 1000 and span["dur"] == (r.answered_unix_ms - r.created_unix_ms) * 1000
            assert span["args"]["kind"] == r.kind and span["args"]["status"] == r.status
            assert span["args"]["cobatched_with"] == r.cobatched_with and span["args"]["cycle"] == r.cycle
            same_track = [s for s in spans(trace) if (s["pid"], s["tid"]) == (span["pid"], span["tid"])
                          and s["cat"] in ("queued", "running") and s["args"]["seq_id"] == r.seq_id]
            queued = [s for s in same_track if s["cat"] == "queued"]
            running = [s for s in same_track if s["cat"] == "running"]
            assert len(queued) == len(running) == 1
            started = r.started_unix_ms or r.answered_unix_ms  # never sent: queued until answered
            assert queued[0]["ts"] == span["ts"] and queued[0]["dur"] == (started - r.created_unix_ms) * 1000
            assert running[0]["ts"] == started * 1000 and running[0]["dur"] == (r.answered_unix_ms - started) * 1000
            assert queued[0]["dur"] + running[0]["dur"] == span["dur"]  # the two children fill their parent
            if r.trainer:
                assert running[0]["name"] == f"trainer {r.trainer} · cycle {r.cycle}"


def test_spans_on_one_track_nest_or_follow_each_other(rows, records):
    trace = build_trace("s", rows, records, T0, T0 + 1000)
    tracks = defaultdict(list)
    for s in spans(trace):
        tracks[(s["pid"], s["tid"])].append(s)
    for track in tracks.values():
        for x in track:
            for y in track:
                if x is y:
                    continue
                x0, x1, y0, y1 = x["ts"], x["ts"] + x["dur"], y["ts"], y["ts"] + y["dur"]
                disjoint = x1 <= y0 or y1 <= x0
                nested = (x0 <= y0 and y1 <= x1) or (y0 <= x0 and x1 <= y1)
                assert disjoint or nested, (x, y)
    # run a's overlapping seqs 1 and 2 went to two tracks, both named after the run
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    a_tracks = {(s["pid"], s["tid"]) for s in spans(trace, "request") if s["args"]["training_run_id"] == "s:train:0"}
    assert sorted(names[t] for t in a_tracks) == ["s:train:0", "s:train:0 #2"]


def test_cycles_span_their_requests_and_sampling_spans_match_records(rows, records):
    trace = build_trace("s", rows, records, T0, T0 + 1000)
    cycles = spans(trace, "cycle")
    assert all(c["pid"] == TRAINERS for c in cycles)
    expected = defaultdict(list)
    for r in [r for v in rows.values() for r in v if r.started_unix_ms]:
        expected[(r.trainer, r.cycle)].append(r)
    assert len(cycles) == len(expected)
    for c in cycles:
        members = expected[(c["args"]["trainer"], c["args"]["cycle"])]
        assert c["ts"] == min(r.started_unix_ms for r in members) * 1000
        assert c["ts"] + c["dur"] == max(r.answered_unix_ms for r in members) * 1000
        assert c["args"]["requests"] == len(members)
    sampled = spans(trace, "sampling")
    assert len(sampled) == len(records) and all(s["pid"] == SAMPLING for s in sampled)
    for rec in records:
        assert sum(1 for s in sampled if s["ts"] == rec.started_unix_ms * 1000
                   and s["dur"] == (rec.answered_unix_ms - rec.started_unix_ms) * 1000
                   and s["args"]["sampler_id"] == rec.sampler_id and s["args"]["tokens_sampled"] == rec.tokens_sampled) == 1


def counter(trace, name):
    return [(e["ts"], next(iter(e["args"].values()))) for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == name]


def test_counters_follow_the_rows(rows, records):
    trace = build_trace("s", rows, records, T0, T0 + 1000)
    assert all(e["pid"] == COUNTERS for e in trace["traceEvents"] if e["ph"] == "C")
    depth = counter(trace, "queue depth")
    # a0 (0), b0 (20) and a1 (50) arrive; a0 and b0 are sent at 100, a1 at 400; a2 waits 800..820 and fails
    assert depth == [((T0 + t) * 1000, v) for t, v in [(0, 1), (20, 2), (50, 3), (100, 1), (400, 0), (800, 1), (820, 0)]]
    assert [t for t, _ in depth] == sorted(t for t, _ in depth)
    active = counter(trace, "active sample requests")
    assert max(v for _, v in active) == 2 and active[-1][1] == 0
    assert counter(trace, "tokens trained")[-1][1] == 10 + 30  # forward_backward rows done; the optim step has none
    assert counter(trace, "tokens sampled")[-1][1] == 21 and counter(trace, "tokens prefilled")[-1][1] == 15
    rate = counter(trace, "tokens trained per second")
    assert sum(v for _, v in rate) * 1.0 == pytest.approx(40.0)  # one 1 s bucket per second over a 1 s range
    json.dumps(trace, allow_nan=False)  # what the route sends: plain JSON


def test_session_series_sums_and_busy_union(rows, records):
    series = session_series(rows, records, T0, T0 + 1000, buckets=4)
    assert series["bucket_seconds"] == 1.0 and len(series["t"]) == 1  # buckets are at least a second
    # the trainer ran this session's work over [100, 700) (a0 and b0 overlapped in [100, 400)): 0.6 of the second
    assert series["trainer_busy_fraction"] == [pytest.approx(0.6)]
    assert series["active_sample_requests"] == [pytest.approx((300 + 100 + 400) / 1000)]
    assert series["tokens_trained_per_s"] == [40.0]
    assert series["tokens_sampled_per_s"] == [21.0] and series["tokens_prefilled_per_s"] == [15.0]
    longer = session_series(rows, records, T0, T0 + 4000, buckets=4)
    assert longer["t"] == [(T0 + i * 1000) / 1000 for i in range(4)]
    assert sum(longer["tokens_trained_per_s"]) == 40.0 and longer["trainer_busy_fraction"][1:] == [0, 0, 0]
