"""Session search filters without a stack (issue 33): the gateway's reading of the SDK's
SessionSearchRequest (services/gateway/session_search.py), checked against the SDK's own JSON, and
the scheduler's SessionQuery checks (scheduler/db/session_search.py)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from temper.common.errors import InvalidArgument
from temper.scheduler.db.session_search import SessionQuery
from temper.services.gateway import session_search as ss
from temper.v1 import records_pb2

tt = pytest.importorskip("tinker.types")


def sdk_body(**fields) -> dict:
    """The JSON the SDK sends (model_dump, mode json, exclude_none), as rest_client does."""
    from tinker._compat import model_dump
    return model_dump(tt.SessionSearchRequest(**fields), mode="json", exclude_none=True)


def test_sdk_defaults_are_the_callers_sessions_fifty_a_page():
    query, owners = ss.search_request(sdk_body())
    assert (query.limit, list(query.statuses), list(query.project_ids), owners) == (50, [], [], ())
    assert not query.after_session_id and not query.display_name


def test_sdk_filters_map_to_the_schedulers():
    when = datetime(2026, 12, 7, 1, 2, 3, 456789, tzinfo=timezone.utc)
    body = sdk_body(session_id="s1", project_ids=["proj-a", "proj-b", "proj-a"], user_metadata={"team": "rl"},
                    display_name="Nightly  SFT", owner=tt.UserSearchOwner(owner_urns=["alice"]), limit=7,
                    statuses=[tt.ActiveSessionStatusQuery(), tt.CancelledSessionStatusQuery(),
                              tt.ClientFinishedSessionStatusQuery(reasons=["errored"])],
                    cursor=tt.SessionSearchCursor(last_created_at=when, last_session_id="s9"))
    query, owners = ss.search_request(body)
    assert list(query.project_ids) == ["proj-a", "proj-b"] and dict(query.user_metadata) == {"team": "rl"}
    assert list(query.statuses) == ["open", "expired", "errored"] and owners == ("alice",)
    assert (query.session_id, query.display_name, query.limit) == ("s1", "Nightly  SFT", 7)
    assert query.after_session_id == "s9"
    assert query.after_created_unix_us == int(when.timestamp()) * 1_000_000 + 456789  # exact to the microsecond
    every_finish, _ = ss.search_request(sdk_body(statuses=[tt.ClientFinishedSessionStatusQuery(), tt.FailedSessionStatusQuery()]))
    assert list(every_finish.statuses) == ["success", "errored", "interrupted", "failed"]


@pytest.mark.parametrize("body,message", [
    ({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"limit": True}, "limit"),
    ({"statuses": []}, "statuses must be a non-empty list"),
    ({"statuses": [{"type": "running"}]}, "statuses[0].type"),
    ({"statuses": [{"type": "active", "reasons": ["success"]}]}, "takes no field 'reasons'"),
    ({"statuses": [{"type": "client_finished", "reasons": ["crashed"]}]}, "statuses[0].reasons"),
    ({"project_ids": "proj-a"}, "project_ids must be a list"),
    ({"project_ids": [""]}, "project_ids must be a list of non-empty strings"),
    ({"user_metadata": {"k": 1}}, "user_metadata"),
    ({"display_name": "   "}, "display_name"),
    ({"display_name": "x" * 257}, "display_name"),
    ({"owner": {"type": "everyone"}}, "owner.type"),
    ({"owner": {"type": "user", "owner_urns": []}}, "owner_urns"),
    ({"owner": {"type": "own", "owner_urns": ["a"]}}, "takes no other fields"),
    ({"cursor": {"last_session_id": "s"}}, "cursor must be"),
    ({"cursor": {"last_created_at": "2026-12-07T01:02:03", "last_session_id": "s"}}, "time zone"),
    ({"cursor": {"last_created_at": "yesterday", "last_session_id": "s"}}, "ISO 8601"),
    ({"sort": "oldest"}, "unknown session search fields: sort"),
])
def test_malformed_filters_are_refused_naming_the_field(body, message):
    with pytest.raises(ValueError, match=None) as refused:
        ss.search_request(body)
    assert message in str(refused.value)


def test_answers_in_the_sdks_shapes():
    created_us = 1_765_000_000_123_456
    rows = [records_pb2.SessionInfo(session_id="s2", created_unix_us=created_us, display_name="run two", project_id="proj-a",
                                    checkpoints_count=3, checkpoint_bytes=10, user_metadata={"k": "v"}),
            records_pb2.SessionInfo(session_id="s1", created_unix_us=created_us - 1, closed=True, close_status="expired")]
    answer = records_pb2.SearchSessionsResponse(sessions=rows, more=True, tenant="alice")
    summaries = [tt.SessionSummary.model_validate(ss.summary(s, answer.tenant)) for s in answer.sessions]
    assert summaries[0].display_name == "run two" and summaries[0].status.type == "active" and summaries[0].owner == "alice"
    assert summaries[1].status.type == "cancelled" and summaries[1].display_name is None
    cursor = tt.SessionSearchCursor.model_validate(ss.next_cursor(answer))
    assert cursor.last_session_id == "s1"
    # the cursor the SDK sends back lands on the same microsecond
    back, _ = ss.search_request(sdk_body(cursor=cursor))
    assert back.after_created_unix_us == created_us - 1
    assert ss.next_cursor(records_pb2.SearchSessionsResponse(sessions=rows, more=False)) is None


def test_scheduler_query_checks():
    query = SessionQuery.from_request(records_pb2.SearchSessionsRequest(display_name="Nightly SFT", statuses=["open", "open"]))
    assert query.words == ("nightly", "sft") and query.statuses == ("open",) and query.limit == 50
    for bad, message in ((dict(limit=201), "limit"), (dict(statuses=["running"]), "unknown session status"),
                         (dict(after_session_id="s"), "cursor"), (dict(after_created_unix_us=5), "cursor"),
                         (dict(display_name=" ".join("w" * 17)), "words")):
        with pytest.raises(InvalidArgument, match=message):
            SessionQuery.from_request(records_pb2.SearchSessionsRequest(**bad))
