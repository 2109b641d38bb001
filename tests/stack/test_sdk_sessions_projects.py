"""Sessions and projects through the unmodified tinker SDK on one gateway stack (issue 33, items 1
and 3): display names, projects (create, ServiceClient(project_id=...), assign_session_project, every
list filtered by project), search_sessions, and expiry of a session whose heartbeats stopped (its
sampling clients then refused as a closed session's). Bad input (another tenant's project or
session, malformed filters, bad names) is refused and changes nothing. One stack for the module (the
suite runs near its time limit); the store's side of each is tested on SQLite in
tests/unit/test_session_projects_store.py."""

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
import sqlalchemy

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402

from fixtures_stack import raw_stub, sdk_rest_client, tinker_sdk_env  # noqa: E402
from temper.client import ModelInput, SamplingParams, convert  # noqa: E402
from temper.common.errors import NotFound  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402
from temper.v1 import service_pb2  # noqa: E402

# The SDK sends a heartbeat every 10 s: 30 s leaves its sessions open. The silent session's last
# heartbeat is set back by that much (no test waits out the timeout); the scheduler's sweep does the rest.
EXPIRE_SECONDS = 30
pytestmark = pytest.mark.filterwarnings("ignore:RestClient.search_sessions is experimental")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_sdk_sessions")
    env = {"TEMPER_SCHEDULER_SESSION_EXPIRE_SECONDS": str(EXPIRE_SECONDS), "TEMPER_SCHEDULER_SESSION_EXPIRE_INTERVAL_SECONDS": "0.5"}
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("sdk-sessions"), database_url=url, num_threads=1, gateway=True,
                    extra_env=env) as local:
        local.address = local.start()  # raw_stub's scheduler address
        yield local


def call(stack, method, path, body=None, key=None):
    """(status, JSON body) of a plain HTTP call with the stack's key (or ``key``)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(stack.gateway_url + path, data=data, method=method,
                                     headers={"X-API-Key": key or stack.api_key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def raw_session(stack, **fields):
    body = {"tags": [], "user_metadata": None, "sdk_version": "test", "type": "create_session", **fields}
    return call(stack, "POST", "/api/v1/create_session", body)


def sample(stub, sampler_id):
    return stub.Sample(service_pb2.SampleRequest(
        sampler_id=sampler_id, prompt=convert.model_input_to_proto(ModelInput.from_ints([5, 6, 7])), num_samples=1,
        sampling_params=convert.sampling_params_to_proto(SamplingParams(max_tokens=2, seed=1))))


@pytest.fixture(scope="module")
def silent(stack, tiny_model_dir):
    """A session made first and never sent a heartbeat, with a sampling client that has sampled."""
    status, body = raw_session(stack, display_name="silent one")
    assert status == 200, body
    stub = raw_stub(stack)
    sampler = stub.CreateSamplingClient(service_pb2.CreateSamplingClientRequest(session_id=body["session_id"],
                                                                               base_model=tiny_model_dir))
    assert len(sample(stub, sampler.sampler_id).sequences) == 1
    return body["session_id"], sampler.sampler_id


@pytest.fixture(scope="module")
def world(stack, silent, tiny_model_dir):
    """Two projects of this tenant, one of another; an SDK session in a project with a run and a
    saved checkpoint, and a second SDK session in none. Yields the names of what was made."""
    other_key = stack.key_for("other-tenant")
    made = {}
    for name in ("nightly", "archive"):
        status, body = call(stack, "POST", "/api/v1/projects", {"name": name})
        assert status == 200 and body["name"] == name, body
        made[name] = body["project_id"]
    status, body = call(stack, "POST", "/api/v1/projects", {"name": "theirs"}, key=other_key)
    made["theirs"], made["other_key"] = body["project_id"], other_key
    with tinker_sdk_env(stack):
        first = tinker.ServiceClient(project_id=made["nightly"], display_name="Nightly SFT run", user_metadata={"team": "rl"})
        second = tinker.ServiceClient(display_name="eval two")
        try:
            tc = first.create_lora_training_client(tiny_model_dir, rank=4, seed=5).result()
            made["run"] = tc.model_id
            made["checkpoint"] = tc.save_state("s1").result().path
            made["first"], made["second"] = tc.model_id.split(":train:")[0], second.holder.get_session_id()
            yield made
        finally:
            first.close("success")
            second.close("success")




def search(stack, **fields):
    return sdk_rest_client(stack).search_sessions(tt.SessionSearchRequest(**fields)).result()


def test_display_name_and_project_round_trip(stack, world):
    client = sdk_rest_client(stack)
    assert client.get_session(world["first"]).result().display_name == "Nightly SFT run"
    assert client.get_session(world["second"]).result().display_name == "eval two"
    runs = client.list_training_runs(project_id=world["nightly"]).result().training_runs
    assert [r.training_run_id for r in runs] == [world["run"]]
    assert client.list_training_runs(project_id=world["archive"]).result().training_runs == []
    status, listed = call(stack, "GET", f"/api/v1/sessions?project_id={world['nightly']}")
    assert (status, listed["sessions"]) == (200, [world["first"]])
    usage = tinker.AdminClient(base_url=stack.gateway_url, api_key=stack.api_key)
    rows = usage.get_current_checkpoint_storage_usage(project_id=world["nightly"]).result().data
    assert [(r.project_id, r.checkpoint_count) for r in rows] == [(world["nightly"], 1)] and rows[0].size_bytes > 0
    # 0.39's search_checkpoints (this SDK is 0.38): its request body, sent as 0.39 sends it
    status, found = call(stack, "POST", "/api/v1/checkpoints/search", {"project_ids": [world["nightly"]]})
    assert status == 200 and [c["tinker_path"] for c in found["checkpoints"]] == [world["checkpoint"]]
    status, found = call(stack, "POST", "/api/v1/checkpoints/search", {"project_ids": [world["archive"]]})
    assert (status, found["checkpoints"]) == (200, [])


def test_another_tenants_project_or_session_is_not_found_and_changes_nothing(stack, world):
    client = sdk_rest_client(stack)
    for name in ("theirs", "missing"):
        project = world.get(name, "proj-0000000000000000")
        with pytest.raises(tinker.NotFoundError):
            client.list_training_runs(project_id=project).result()
        with pytest.raises(tinker.NotFoundError):
            client.assign_session_project(world["second"], project).result()
        status, _ = raw_session(stack, project_id=project)
        assert status == 404
        for path in ("/api/v1/sessions/search", "/api/v1/checkpoints/search"):
            assert call(stack, "POST", path, {"project_ids": [project]})[0] == 404
    with pytest.raises(tinker.NotFoundError):  # this tenant's project, the other tenant's session
        sdk_rest_client(stack, world["other_key"]).assign_session_project(world["second"], world["theirs"]).result()
    assert search(stack, session_id=world["second"]).sessions[0].project_id == ""  # unchanged
    assert call(stack, "GET", "/api/v1/sessions/" + world["second"], key=world["other_key"])[0] == 404


def test_bad_names_and_filters_are_refused(stack, world):
    for name in ("tab\there", "x" * 257, "   "):
        assert raw_session(stack, display_name=name)[0] == 400
        assert call(stack, "POST", "/api/v1/projects", {"name": name})[0] == 400
    assert call(stack, "POST", "/api/v1/projects", {"name": "nightly"})[0] == 409
    for body in ({"statuses": [{"type": "running"}]}, {"limit": 0}, {"cursor": {"last_session_id": "x"}}, {"sort": "new"}):
        status, answer = call(stack, "POST", "/api/v1/sessions/search", body)
        assert status == 400 and answer, body


def test_assign_and_search(stack, world, silent):
    client, silent = sdk_rest_client(stack), silent[0]
    client.assign_session_project(world["second"], world["archive"]).result()
    hits = search(stack, project_ids=[world["archive"]]).sessions
    assert [(s.session_id, s.display_name, s.project_id) for s in hits] == [(world["second"], "eval two", world["archive"])]
    first = search(stack, display_name="sft NIGHTLY").sessions
    assert [s.session_id for s in first] == [world["first"]]
    assert (first[0].checkpoints_count, first[0].status.type, first[0].user_metadata) == (1, "active", {"team": "rl"})
    assert [s.session_id for s in search(stack, user_metadata={"team": "rl"}).sessions] == [world["first"]]
    assert search(stack, owner=tt.UserSearchOwner(owner_urns=["someone-else"])).sessions == []
    # newest first, a page at a time: the three sessions of this module (and none of the other tenant's)
    pages, request = [], tt.SessionSearchRequest(limit=1)
    while True:
        page = client.search_sessions(request).result()
        pages.extend(s.session_id for s in page.sessions)
        if page.next_cursor is None:
            break
        request = request.model_copy(update={"cursor": page.next_cursor})
    assert pages == [world["second"], world["first"], silent]


def test_a_silent_session_expires_releases_its_samplers_and_refuses_heartbeats(stack, world, silent):
    silent, sampler_id = silent
    # silent and idle for longer than the timeout: its heartbeat and its one sample set back
    engine = sqlalchemy.create_engine(stack.database_url)
    with engine.begin() as db:
        db.execute(sqlalchemy.text("UPDATE sessions SET last_heartbeat_at = last_heartbeat_at - make_interval(secs => :s) "
                                   "WHERE id = :id"), {"s": EXPIRE_SECONDS + 1, "id": silent})
        db.execute(sqlalchemy.text("UPDATE sampling_records SET started_ms = started_ms - :ms, answered_ms = answered_ms - :ms "
                                   "WHERE session_id = :id"), {"ms": (EXPIRE_SECONDS + 1) * 1000, "id": silent})
    engine.dispose()
    deadline = time.monotonic() + 2 * EXPIRE_SECONDS  # the scheduler also waits until it has been up EXPIRE_SECONDS
    cancelled = [tt.CancelledSessionStatusQuery()]
    while not search(stack, session_id=silent, statuses=cancelled).sessions:
        assert time.monotonic() < deadline, "the silent session did not expire"
        time.sleep(0.5)
    status, body = call(stack, "POST", "/api/v1/session_heartbeat", {"session_id": silent, "type": "session_heartbeat"})
    assert status == 410 and "expired" in json.dumps(body)
    with pytest.raises(grpc.RpcError) as refused:  # released as CloseSession releases them
        sample(raw_stub(stack), sampler_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    active = {s.session_id for s in search(stack, statuses=[tt.ActiveSessionStatusQuery()]).sessions}
    assert {world["first"], world["second"]} <= active and silent not in active  # the SDK's heartbeats keep theirs open
    status, audit = call(stack, "GET", "/api/v1/audit?event_type=all")
    assert status == 200, audit
    assert silent in json.dumps(audit) and "session.expire" in json.dumps(audit)
    projects = call(stack, "GET", "/api/v1/audit?event_type=projects")[1]["entries"]
    assert sorted({e["event"] for e in projects}) == ["project_create", "session_project"]


def test_temper_client_names_and_moves_its_session(stack, world):
    with stack.client(display_name="over grpc", project_id=world["archive"]) as ours:
        found = search(stack, session_id=ours.session_id).sessions
        assert [(s.display_name, s.project_id) for s in found] == [("over grpc", world["archive"])]
        ours.create_rest_client().assign_session_project(ours.session_id, world["nightly"]).result()
        assert search(stack, session_id=ours.session_id).sessions[0].project_id == world["nightly"]
        with pytest.raises(NotFound):
            ours.create_rest_client().assign_session_project(ours.session_id, world["theirs"]).result()
