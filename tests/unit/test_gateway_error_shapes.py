"""Every error under /v1 in the shape its clients read, in process (fastapi's TestClient), with a
scheduler stand-in that records what reaches it: OpenAI's {"error": {message, type, param, code}} for
unknown routes (404), bad JSON (400), a missing or malformed key (401), FastAPI's own validation
(422 answered 400) and scheduler statuses; Anthropic's {"type": "error", "error": {type, message}} on
/v1/messages; the Tinker routes keep the SDK's shape. Refused requests reach no scheduler call."""

import grpc
import pytest
from fastapi.testclient import TestClient

from temper.services.gateway.app import create_app
from temper.services.gateway.errors import GatewayError

KEY = {"Authorization": "Bearer tml-k"}
OPENAI_KEYS = {"message", "type", "param", "code"}


class Scheduler:
    def __init__(self, error: GatewayError | None = None):
        self.calls, self.error = [], error

    async def call(self, method, request, key):
        self.calls.append(method)
        raise self.error or GatewayError(grpc.StatusCode.UNAVAILABLE, "no scheduler here")

    async def verb(self, method, request, key):
        return await self.call(method, request, key)

    async def close(self):
        pass


@pytest.fixture
def scheduler():
    return Scheduler()


@pytest.fixture
def client(scheduler):
    with TestClient(create_app(scheduler)) as client:
        yield client


def openai_error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == OPENAI_KEYS and isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("prefix", ["/v1", "/oai/api/v1"])
def test_openai_paths_answer_every_error_in_openai_shape(client, scheduler, prefix):
    assert openai_error(client.get(f"{prefix}/no/such/route", headers=KEY), 404)["type"] == "not_found_error"
    assert "POST" in openai_error(client.post(f"{prefix}/embeddings", headers=KEY, json={}), 404)["message"]
    assert openai_error(client.get(f"{prefix}/completions", headers=KEY), 404)  # a method no route has
    bad = openai_error(client.post(f"{prefix}/chat/completions", headers=KEY, content=b"{not json"), 400)
    assert bad["type"] == "invalid_request_error" and "not JSON" in bad["message"]
    assert openai_error(client.post(f"{prefix}/completions", content=b"{}"), 401)["code"] == "invalid_api_key"
    assert openai_error(client.post(f"{prefix}/completions", headers={"Authorization": "Bearer \x01"}, json={}), 401)
    assert openai_error(client.post(f"{prefix}/completions", headers=KEY, json={"model": "m", "prompt": "hi", "n": 0}),
                        400)["type"] == "invalid_request_error"
    assert scheduler.calls == []  # none of these reached the scheduler


def test_scheduler_statuses_keep_their_meaning_in_openai_shape(scheduler, client):
    scheduler.error = GatewayError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
    assert openai_error(client.get("/v1/models", headers=KEY), 401)["code"] == "invalid_api_key"
    scheduler.error = GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down")
    assert openai_error(client.get("/v1/models/some-model", headers=KEY), 429)["type"] == "rate_limit_error"
    scheduler.error = GatewayError(grpc.StatusCode.UNAVAILABLE, "restarting")
    resp = client.get("/v1/models", headers=KEY)
    assert openai_error(resp, 503)["type"] == "server_error" and resp.headers["x-should-retry"] == "true"


def test_messages_answers_in_anthropic_shape(client, scheduler):
    def anthropic_error(resp, status: int, kind: str) -> str:
        assert resp.status_code == status, resp.text
        body = resp.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
        return body["error"]["message"]

    anthropic_error(client.post("/v1/messages", json={}), 401, "authentication_error")
    headers = {"x-api-key": "tml-k", "anthropic-version": "2023-06-01"}
    anthropic_error(client.post("/v1/messages", headers=headers, content=b"[1,"), 400, "invalid_request_error")
    base = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert "max_tokens" in anthropic_error(client.post("/v1/messages", headers=headers, json={**base, "max_tokens": None}),
                                           400, "invalid_request_error")
    for bad in ({"tools": [{"name": "x"}]}, {"messages": []}, {"messages": [{"role": "system", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {"stop_sequences": "END"}, {"temperature": -1}, {"thinking": {"type": "enabled", "budget_tokens": 10}}):
        anthropic_error(client.post("/v1/messages", headers=headers, json={**base, **bad}), 400, "invalid_request_error")
    anthropic_error(client.post("/v1/messages/batches", headers=headers, json={}), 404, "not_found_error")
    assert scheduler.calls == []
    scheduler.error = GatewayError(grpc.StatusCode.UNAVAILABLE, "restarting")
    anthropic_error(client.post("/v1/messages", headers=headers, json=base), 503, "overloaded_error")


def test_tinker_routes_keep_the_sdk_shape(client):
    resp = client.get("/api/v1/no_such_route", headers=KEY)
    assert resp.status_code == 404 and set(resp.json()) == {"error", "code", "category"}
