"""The console's HTTP routes (services/gateway/console/) in front of a recording fake scheduler:
bad forms are refused before any scheduler call, GETs make read calls only, the scheduler's
NOT_FOUND for another tenant's id is a 404, a trace range over the row budget is refused, and the
pages carry their security headers and load nothing from elsewhere."""

import re
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from temper.services.gateway.app import create_app
from temper.services.gateway.console.pages import STATIC
from temper.services.gateway.errors import GatewayError
from temper.v1 import records_pb2, service_pb2, types_pb2

KEY = {"X-API-Key": "tml-" + "a" * 43}
READS = {"GetUsage", "ListTrainingRuns", "GetInfo", "ListCheckpoints", "ListRunMetrics", "ListSessions", "GetSession",
         "GetSessionSamplingMetrics", "ListApiKeys", "GetAuditLog", "GetClusterStatus", "GetServerCapabilities"}


ANSWERS = {"ListTrainingRuns": service_pb2.ListTrainingRunsResponse, "GetInfo": service_pb2.TrainingRunInfo,
           "ListCheckpoints": service_pb2.ListCheckpointsResponse, "ListSessions": records_pb2.ListSessionsResponse,
           "ListApiKeys": service_pb2.ListApiKeysResponse, "GetAuditLog": service_pb2.GetAuditLogResponse,
           "GetClusterStatus": service_pb2.ClusterStatus, "GetServerCapabilities": service_pb2.GetServerCapabilitiesResponse}


class FakeScheduler:
    def __init__(self):
        self.calls = []
        self.metric_pages = 1

    async def close(self):
        pass

    async def call(self, method, request, key):
        self.calls.append((method, request, key))
        if "other" in str(getattr(request, "session_id", "")) + str(getattr(request, "training_run_id", "")) \
                + str(getattr(request, "path", "")):
            raise GatewayError(grpc.StatusCode.NOT_FOUND, "not found")
        if method == "GetSession":
            return records_pb2.SessionInfo(session_id=request.session_id, created_unix_ms=1000, closed=True,
                                           closed_unix_ms=5000, training_run_ids=[f"{request.session_id}:train:0"])
        if method == "ListRunMetrics":
            n = int(request.page_token or 0)
            rows = [records_pb2.RunMetric(seq_id=n * 10 + i + 1, kind="forward_backward", status="done",
                                          created_unix_ms=1000 + i, started_unix_ms=1100 + i, answered_unix_ms=1200 + i)
                    for i in range(10)]
            more = n + 1 < self.metric_pages
            return records_pb2.ListRunMetricsResponse(metrics=rows, next_page_token=str(n + 1) if more else "")
        if method == "GetSessionSamplingMetrics":
            return records_pb2.GetSessionSamplingMetricsResponse()
        if method == "UpdateCheckpoint":
            return types_pb2.Checkpoint(path=request.path, published=request.published)
        if method == "GetUsage":
            return service_pb2.UsageResponse(tenant="alice")
        return ANSWERS[method]()


@pytest.fixture
def fake():
    return FakeScheduler()


@pytest.fixture
def client(fake):
    app = create_app(fake)
    app.state.console_max_rows = 25
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize("route,body", [
    ("/console/api/checkpoints/publish", {"path": "tinker://r/weights/a", "published": "true"}),
    ("/console/api/checkpoints/publish", {"path": "tinker://r/weights/a"}),
    ("/console/api/checkpoints/publish", {"path": "tinker://r/weights/a", "published": True, "extra": 1}),
    ("/console/api/checkpoints/publish", {"path": "/etc/passwd", "published": True}),
    ("/console/api/checkpoints/ttl", {"path": "tinker://r/weights/a", "ttl_seconds": -1}),
    ("/console/api/checkpoints/ttl", {"path": "tinker://r/weights/a", "ttl_seconds": 1.5}),
    ("/console/api/checkpoints/ttl", {"path": "tinker://r/weights/a", "ttl_seconds": 10**12}),
    ("/console/api/checkpoints/delete", {"path": "tinker://r/nonsense/a"}),
    ("/console/api/keys/create", {"label": "x" * 129}),
    ("/console/api/keys/revoke", {"prefix": ""}),
])
def test_bad_forms_are_refused_before_any_scheduler_call(client, fake, route, body):
    resp = client.post(route, json=body, headers=KEY)
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "INVALID_ARGUMENT"
    assert fake.calls == []


def test_no_key_is_401_before_the_body_is_read(client, fake):
    assert client.post("/console/api/checkpoints/publish", content=b"{not json").status_code == 401
    assert client.get("/console/api/runs").status_code == 401
    assert client.get("/api/v1/sessions/s/trace").status_code == 401
    assert fake.calls == []


def test_a_good_form_makes_one_change_with_the_callers_key(client, fake):
    resp = client.post("/console/api/checkpoints/publish", json={"path": "tinker://r/weights/a", "published": True},
                       headers=KEY)
    assert resp.status_code == 200 and resp.json()["published"] is True
    [(method, request, key)] = fake.calls
    assert (method, request.path, request.published, key) == ("UpdateCheckpoint", "tinker://r/weights/a", True, KEY["X-API-Key"])


@pytest.mark.parametrize("path", ["/console/api/usage", "/console/api/runs", "/console/api/runs/s:train:0",
                                  "/console/api/runs/s:train:0/metrics", "/console/api/checkpoints",
                                  "/console/api/sessions", "/console/api/sessions/s", "/console/api/sessions/s/metrics",
                                  "/console/api/keys", "/console/api/audit", "/console/api/cluster", "/console/api/me",
                                  "/console/api/models", "/api/v1/sessions/s/trace"])
def test_gets_make_read_calls_only(client, fake, path):
    resp = client.get(path, headers=KEY)
    assert resp.status_code == 200, resp.text
    assert fake.calls and {m for m, _, _ in fake.calls} <= READS


@pytest.mark.parametrize("path", ["/console/api/runs/other:train:0", "/console/api/runs/other:train:0/metrics",
                                  "/console/api/sessions/other", "/console/api/sessions/other/metrics",
                                  "/api/v1/sessions/other/trace"])
def test_another_tenants_ids_are_404(client, path):
    resp = client.get(path, headers=KEY)
    assert resp.status_code == 404 and resp.json()["code"] == "NOT_FOUND"


def test_a_range_over_the_row_budget_is_refused(client, fake):
    fake.metric_pages = 2  # 20 rows: within the budget of 25
    assert client.get("/api/v1/sessions/s/trace", headers=KEY).status_code == 200
    fake.metric_pages = 3  # 30 rows
    resp = client.get("/api/v1/sessions/s/trace", headers=KEY)
    assert resp.status_code == 400 and "narrow it" in resp.json()["error"]
    assert client.get("/console/api/runs/s:train:0/metrics", headers=KEY).status_code == 400
    for bad in ("from_unix_ms=-1", "from_unix_ms=x", "from_unix_ms=5000&to_unix_ms=4000",
                f"from_unix_ms=0&to_unix_ms={40 * 86_400_000}"):
        assert client.get(f"/api/v1/sessions/s/trace?{bad}", headers=KEY).status_code == 400, bad


def test_runs_carry_their_sessions_state(client, fake):
    fake_runs = service_pb2.ListTrainingRunsResponse(training_runs=[
        service_pb2.TrainingRunInfo(training_run_id="s1:train:0"), service_pb2.TrainingRunInfo(training_run_id="s1:train:1"),
        service_pb2.TrainingRunInfo(training_run_id="s2:train:0")], total_count=3)
    ANSWERS["ListTrainingRuns"] = lambda: fake_runs
    try:
        runs = client.get("/console/api/runs", headers=KEY).json()["runs"]
    finally:
        ANSWERS["ListTrainingRuns"] = service_pb2.ListTrainingRunsResponse
    assert [r["status"] for r in runs] == ["closed (unknown)", "closed (unknown)", "closed (unknown)"]
    assert sorted(r.session_id for m, r, _ in fake.calls if m == "GetSession") == ["s1", "s2"]  # once per session


def test_the_trace_is_an_attachment_of_the_sessions_range(client, fake):
    fake.metric_pages = 1
    resp = client.get("/api/v1/sessions/s/trace", headers=KEY)
    assert resp.headers["content-disposition"] == 'attachment; filename="temper-trace-s.json"'
    trace = resp.json()
    assert trace["otherData"] == {"session_id": "s", "from_unix_ms": 1000, "to_unix_ms": 5001, "requests": 10,
                                  "sampling_calls": 0}


def test_pages_carry_security_headers_and_fetch_nothing_elsewhere(client):
    page = client.get("/console/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY"
    assert client.get("/console", follow_redirects=False).status_code == 307
    sources = [p for p in Path(STATIC).rglob("*") if p.suffix in (".html", ".js", ".css") and "vendor" not in p.parts]
    assert len(sources) > 10
    for source in sources:
        text = source.read_text()
        assert not re.search(r"https?://", text), source  # no CDN, no other host
        assert "innerHTML" not in text, source  # text goes in as text nodes
        assert "localStorage" not in text and "document.cookie" not in text, source
    for ref in re.findall(r'(?:src|href)="(/console/static/[^"]+)"', page.text):
        assert client.get(ref).status_code == 200, ref
    assert client.get("/console/api/usage", headers=KEY).headers["cache-control"] == "no-store"
