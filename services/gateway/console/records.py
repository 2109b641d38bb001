"""Reading a session's kept records from the scheduler, page by page, within a row budget: a range
holding more rows than the budget is refused (400, "narrow the range"), never gathered unbounded."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from temper.services.gateway.errors import GatewayError
from temper.v1 import records_pb2

PAGE = 1000  # the scheduler's largest page
MAX_RUNS = 200  # a session's runs read for one answer


class TooLarge(GatewayError):
    def __init__(self, what: str, budget: int):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT,
                         f"the range holds more than {budget} {what}: narrow it (from_unix_ms, to_unix_ms)")


@dataclass
class SessionRecords:
    session: records_pb2.SessionInfo
    run_rows: dict[str, list] = field(default_factory=dict)  # run id -> RunMetric rows answered in range
    sampling: list = field(default_factory=list)              # SamplingRecord rows started in range


def in_range(row, start_ms: int, end_ms: int) -> bool:
    """A request row overlaps [start, end)."""
    return row.answered_unix_ms >= start_ms and row.created_unix_ms < end_ms


async def session_records(call, session: records_pb2.SessionInfo, start_ms: int, end_ms: int, budget: int,
                          sampling: bool = True) -> SessionRecords:
    """``call(method, request)`` is one scheduler call with the caller's key; ``session`` is what
    GetSession answered it. Every page of every run is read; at most ``budget`` rows are kept overall."""
    session_id = session.session_id
    out = SessionRecords(session)
    kept = 0
    for run_id in list(session.training_run_ids)[:MAX_RUNS]:
        rows, token = [], ""
        while True:
            page = await call("ListRunMetrics", records_pb2.ListRunMetricsRequest(
                training_run_id=run_id, page_size=PAGE, page_token=token))
            for row in page.metrics:
                if in_range(row, start_ms, end_ms):
                    rows.append(row)
                    kept += 1
                    if kept > budget:
                        raise TooLarge("requests and samples", budget)
            token = page.next_page_token
            if not token:
                break
        out.run_rows[run_id] = rows
    if sampling:
        token = ""
        while True:
            page = await call("GetSessionSamplingMetrics", records_pb2.GetSessionSamplingMetricsRequest(
                session_id=session_id, from_unix_ms=start_ms, to_unix_ms=end_ms, page_size=PAGE, page_token=token))
            out.sampling.extend(page.records)
            kept += len(page.records)
            if kept > budget:
                raise TooLarge("requests and samples", budget)
            token = page.next_page_token
            if not token:
                break
    return out
