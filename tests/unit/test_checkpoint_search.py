"""Tinker 0.39's checkpoint search: the filter and cursor paging shared by the gateway's
POST /api/v1/checkpoints/search and temper.client's RestClient.search_checkpoints."""

from datetime import datetime, timezone

import pytest

from temper.client import types as t
from temper.common import checkpoint_search as cs
from temper.v1 import types_pb2

T0 = 1_760_000_000_123


def ckpt(run, kind, name, ms, base="m/a", **metadata):
    segment = "weights" if kind == "training" else "sampler_weights"
    return types_pb2.Checkpoint(
        checkpoint_id=f"{segment}/{name}", path=f"tinker://{run}/{segment}/{name}", training_run_id=run, created_unix_ms=ms,
        kind=types_pb2.CHECKPOINT_KIND_TRAINING if kind == "training" else types_pb2.CHECKPOINT_KIND_SAMPLER,
        base_model=base, user_metadata=metadata)


EVERY = [
    ckpt("r1", "training", "a", T0, step="1"),
    ckpt("r1", "sampler", "a", T0 + 1, step="1"),
    ckpt("r2", "training", "b", T0 + 2, base="m/b", step="2", tag="x"),
    ckpt("r2", "sampler", "b", T0 + 2, base="m/b", step="2"),  # same time as the one above: ordered by path
    ckpt("r3", "training", "c", T0 + 5),
]


def paths(page):
    return [c.path for c in page]


def test_defaults_newest_first_ties_by_path():
    page, cursor = cs.search(EVERY, cs.parse_query({}))
    assert paths(page) == ["tinker://r3/weights/c", "tinker://r2/weights/b", "tinker://r2/sampler_weights/b",
                           "tinker://r1/sampler_weights/a", "tinker://r1/weights/a"]
    assert cursor is None
    assert cs.parse_query({}).limit == 50


@pytest.mark.parametrize("body,expected", [
    ({"checkpoint_type": "sampler"}, ["tinker://r2/sampler_weights/b", "tinker://r1/sampler_weights/a"]),
    ({"checkpoint_type": "external"}, []),
    ({"base_models": ["m/b"]}, ["tinker://r2/weights/b", "tinker://r2/sampler_weights/b"]),
    ({"base_models": []}, []),
    ({"base_models": ["m/a", "m/z"], "checkpoint_type": "training"}, ["tinker://r3/weights/c", "tinker://r1/weights/a"]),
    ({"user_metadata": {"step": "2"}}, ["tinker://r2/weights/b", "tinker://r2/sampler_weights/b"]),
    ({"user_metadata": {"step": "2", "tag": "x"}}, ["tinker://r2/weights/b"]),
    ({"user_metadata": {"step": "3"}}, []),
    ({"owner": {"type": "accessible"}, "project_ids": []}, paths(sorted(EVERY, key=lambda c: (c.created_unix_ms, c.path), reverse=True))),
])
def test_filters(body, expected):
    assert paths(cs.search(EVERY, cs.parse_query(body))[0]) == expected


def test_owner_user_matches_the_callers_tenant_only():
    query = cs.parse_query({"owner": {"type": "user", "owner_urns": ["local", "other"]}})
    assert len(cs.search(EVERY, query, caller="local")[0]) == 5
    assert cs.search(EVERY, query, caller="someone") == ([], None)
    assert cs.search(EVERY, query, caller=None) == ([], None)


def test_cursor_pages_through_everything_once():
    seen, cursor = [], None
    while True:
        body = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page, cursor = cs.search(EVERY, cs.parse_query(body))
        seen += paths(page)
        assert len(page) <= 2
        if cursor is None:
            break
        assert set(cursor) == {"last_created_at", "last_checkpoint_uuid"}
        assert datetime.fromisoformat(cursor["last_created_at"]).tzinfo is not None
    assert seen == paths(cs.search(EVERY, cs.parse_query({}))[0])


def test_cursor_round_trips_milliseconds_and_z_suffix():
    c = ckpt("r9", "training", "z", 1_700_000_000_999)
    cursor = cs.cursor_of(c)
    assert cs.parse_query({"cursor": cursor}).after == (1_700_000_000_999, c.path)
    z = cursor["last_created_at"].replace("+00:00", "Z")
    assert cs.parse_query({"cursor": {**cursor, "last_created_at": z}}).after[0] == 1_700_000_000_999


def test_exact_last_page_has_no_cursor():
    page, cursor = cs.search(EVERY, cs.parse_query({"limit": 5}))
    assert len(page) == 5 and cursor is None


@pytest.mark.parametrize("body,message", [
    ({"project_ids": "p1"}, "project_ids must be a list of strings"),
    ({"limit": 0}, "limit"),
    ({"limit": 201}, "limit"),
    ({"limit": True}, "limit"),
    ({"checkpoint_type": "weights"}, "checkpoint_type"),
    ({"owner": {"type": "everyone"}}, "owner.type"),
    ({"owner": {"type": "user", "owner_urns": []}}, "owner_urns"),
    ({"owner": {"type": "user"}}, "owner.owner_urns"),
    ({"owner": {"type": "own", "owner_urns": ["x"]}}, "no other fields"),
    ({"user_metadata": {"a": 1}}, "user_metadata"),
    ({"base_models": "m/a"}, "base_models"),
    ({"cursor": {"last_created_at": "2026-01-01T00:00:00", "last_checkpoint_uuid": "x"}}, "time zone"),
    ({"cursor": {"last_created_at": "yesterday", "last_checkpoint_uuid": "x"}}, "ISO 8601"),
    ({"cursor": "abc"}, "next_cursor"),
    ({"display_name": "x"}, "unknown"),
])
def test_bad_requests(body, message):
    with pytest.raises(ValueError, match=message):
        cs.parse_query(body)


def test_client_request_serializes_as_the_sdk_does():
    when = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc)
    request = t.CheckpointSearchRequest(user_metadata={"k": "v"}, checkpoint_type="training", base_models=["m/a"],
                                        owner=t.UserSearchOwner(owner_urns=["local"]), limit=7)
    body = request.to_json()
    assert body == {"user_metadata": {"k": "v"}, "limit": 7, "owner": {"type": "user", "owner_urns": ["local"]},
                    "base_models": ["m/a"], "checkpoint_type": "training"}
    paged = request.model_copy(update={"cursor": t.CheckpointSearchCursor(when, "tinker://r/weights/a")})
    query = cs.parse_query(paged.to_json())
    assert query.after == (round(when.timestamp() * 1000), "tinker://r/weights/a") and query.limit == 7
    assert cs.parse_query(t.CheckpointSearchRequest().to_json()) == cs.parse_query({})
