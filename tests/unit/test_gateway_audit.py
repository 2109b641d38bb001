"""GET /api/v1/audit (the SDK's AdminClient.get_audit_log) in process, on a scheduler stand-in that
pages GetAuditLog: the day's window asked for, every page read, entries oldest first in the SDK's
shape, event_type filters, bad input refused before any call, and a day too large refused rather
than built."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from fastapi.testclient import TestClient

from temper.services.gateway import routes_audit
from temper.services.gateway.app import create_app
from temper.v1 import service_pb2

KEY = {"X-API-Key": "tml-k"}
DAY_MS = int(datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp() * 1000)
ACTIONS = ["session.open", "checkpoint.publish", "api_key.create", "checkpoint.delete", "session.close"]


class Scheduler:
    """GetAuditLog over ``count`` entries, newest first, in pages of the size asked."""

    def __init__(self, count: int = 5):
        self.calls = []
        self.entries = [service_pb2.AuditEntry(id=i + 1, at_unix_ms=DAY_MS + 1000 * i, tenant="alice", key_prefix="tml-abcdefgh",
                                               actor="api", action=ACTIONS[i % len(ACTIONS)],
                                               target=f"tinker://s:train:0/sampler_weights/w{i}" if "checkpoint" in ACTIONS[i % 5]
                                               else f"s{i}", details={"n": str(i)})
                        for i in range(count)][::-1]

    async def call(self, method, request, key):
        assert method == "GetAuditLog" and key == "tml-k"
        self.calls.append(service_pb2.GetAuditLogRequest.FromString(request.SerializeToString()))
        start = int(request.page_token) if request.page_token else 0
        page = self.entries[start:start + request.page_size]
        more = start + request.page_size < len(self.entries)
        return service_pb2.GetAuditLogResponse(entries=page, next_page_token=str(start + request.page_size) if more else "")

    async def close(self):
        pass


def client(scheduler) -> TestClient:
    return TestClient(create_app(scheduler, long_poll_seconds=5), raise_server_exceptions=False)


def test_a_day_of_entries_in_the_sdks_shape(monkeypatch):
    monkeypatch.setattr(routes_audit, "PAGE", 2)  # three pages for five entries
    scheduler = Scheduler(5)
    with client(scheduler) as http:
        resp = http.get("/api/v1/audit", params={"day": "2026-12-01"}, headers=KEY)
    assert resp.status_code == 200, resp.text
    entries = resp.json()["entries"]
    assert [e["event"] for e in entries] == ["session_open", "checkpoint_publish", "api_key_create", "checkpoint_delete",
                                             "session_close"]
    assert [c.page_token for c in scheduler.calls] == ["", "2", "4"]
    assert {(c.from_unix_ms, c.to_unix_ms) for c in scheduler.calls} == {(DAY_MS, DAY_MS + 86_400_000)}
    publish = entries[1]
    assert publish["tinker_path"] == "tinker://s:train:0/sampler_weights/w1" and publish["model_id"] == "s:train:0"
    assert publish["event_details"] == {"tenant": "alice", "key_prefix": "tml-abcdefgh", "actor": "api",
                                        "action": "checkpoint.publish", "target": publish["tinker_path"], "id": 2, "n": "1"}
    assert publish["timestamp"].startswith("2026-12-01T00:00:01")
    import tinker.types as tt  # the SDK's own type reads it
    assert tt.AuditLogResponse.model_validate(resp.json()).entries[0].event == "session_open"


@pytest.mark.parametrize("event_type, events", [
    ("checkpoints", ["checkpoint_publish", "checkpoint_delete"]),
    ("organizations", ["api_key_create"]),
    ("projects", []),
    ("teams", []),
])
def test_event_types(event_type, events):
    with client(Scheduler(5)) as http:
        resp = http.get("/api/v1/audit", params={"event_type": event_type, "day": "2026-12-01"}, headers=KEY)
    assert resp.status_code == 200 and [e["event"] for e in resp.json()["entries"]] == events


@pytest.mark.parametrize("params", [{"event_type": "billing"}, {"day": "yesterday"}, {"day": "2026-13-01"},
                                    {"day": "2026-12-01T00:00"}, {"day": "x" * 5000}])
def test_bad_input_is_refused_before_any_call(params):
    scheduler = Scheduler()
    with client(scheduler) as http:
        resp = http.get("/api/v1/audit", params=params, headers=KEY)
        assert resp.status_code == 400 and len(resp.text) < 1000, resp.text
        assert http.get("/api/v1/audit").status_code == 401  # no key
    assert scheduler.calls == []


def test_a_day_over_the_bound_is_refused_not_built(monkeypatch):
    monkeypatch.setattr(routes_audit, "MAX_ENTRIES", 3)
    monkeypatch.setattr(routes_audit, "PAGE", 2)
    scheduler = Scheduler(9)
    with client(scheduler) as http:
        resp = http.get("/api/v1/audit", headers=KEY)
    assert resp.status_code == 400 and "audit-log" in resp.text
    assert len(scheduler.calls) == 2  # it stopped reading once past the bound
