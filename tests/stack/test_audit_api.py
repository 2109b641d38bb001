"""The audit log, the tenant's own API keys and the operator's status on the real three-process stack
with its HTTP gateway, on PostgreSQL: every audited action through the API and the admin command
leaves exactly one entry naming the key and what it did; refused calls leave none; tenants see only
their own entries and keys, an admin key everything; GetClusterStatus is an admin's only; the SDK's
AdminClient.get_audit_log reads the same entries."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from fixtures_stack import sft_datum
from temper.client import AdamParams
from temper.scheduler.admin import create_key
from temper.v1 import service_pb2, service_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def audit_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_audit_api")
    env = {"TEMPER_SCHEDULER_KEY_CACHE_SECONDS": "300"}  # a key revoked through the API must not wait for it
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("audit"), database_url=url, extra_env=env, num_threads=1,
                    gateway=True) as local:
        local.address = local.start()
        local.admin_key = create_key(url, "ops", label="operator", is_admin=True)
        yield local


def stub(stack, key: str):
    channel = grpc.insecure_channel(stack.address)
    stub = service_pb2_grpc.TemperStub(channel)
    return stub, [("authorization", f"Bearer {key}")]


def audit(stack, key: str, **request) -> list[service_pb2.AuditEntry]:
    s, md = stub(stack, key)
    return list(s.GetAuditLog(service_pb2.GetAuditLogRequest(page_size=1000, **request), metadata=md, timeout=30).entries)


def code_of(call, request, metadata) -> grpc.StatusCode:
    try:
        call(request, metadata=metadata, timeout=60)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def admin_command(stack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TEMPER_SCHEDULER_DATABASE_URL": stack.database_url}
    return subprocess.run([sys.executable, "-m", "temper.scheduler.admin", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_audited_action_leaves_one_entry_naming_the_key(audit_stack, tiny_model_dir, tmp_path):
    key = audit_stack.key_for("alice")
    prefix = key[:12]
    alice = audit_stack.client("alice")
    session = alice.session_id
    run = alice.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
    run.forward_backward([sft_datum([3, 9, 27, 81, 5, 15])]).result()
    run.optim_step(AdamParams(learning_rate=1e-2)).result()
    path = run.save_weights_for_sampler("w").result().path
    alice.publish_checkpoint(path)
    alice.publish_checkpoint(path)  # published already: nothing changes, nothing is logged again
    alice.unpublish_checkpoint(path)
    alice.set_checkpoint_ttl(path, 3600)
    folder = alice.download_checkpoint(path, tmp_path / "w")
    imported = alice.import_checkpoint(folder, "again").path
    alice.delete_checkpoint(path)
    s, md = stub(audit_stack, key)
    made = s.CreateApiKey(service_pb2.CreateApiKeyRequest(label="ci"), metadata=md)
    assert made.api_key.startswith("tml-") and made.key.prefix == made.api_key[:12] and not made.key.is_admin
    fresh, fresh_md = stub(audit_stack, made.api_key)
    assert fresh.GetUsage(service_pb2.GetUsageRequest(), metadata=fresh_md).tenant == "alice"  # the new key works (and is cached)
    s.RevokeApiKey(service_pb2.RevokeApiKeyRequest(key=made.key.prefix), metadata=md)
    quota = admin_command(audit_stack, "set-quota", "--tenant", "alice", "--max-training-runs", "9")
    assert quota.returncode == 0, quota.stderr
    alice.close()

    mine = [(e.action, e.target, e.key_prefix, e.actor) for e in reversed(audit(audit_stack, key))]
    assert mine == [
        ("api_key.create", prefix, "", "admin-command"),  # the stack made alice's key with the admin command
        ("session.open", session, prefix, "api"),
        ("checkpoint.save", path, prefix, "api"),
        ("checkpoint.publish", path, prefix, "api"),
        ("checkpoint.unpublish", path, prefix, "api"),
        ("checkpoint.ttl", path, prefix, "api"),
        ("checkpoint.import", imported, prefix, "api"),
        ("checkpoint.delete", path, prefix, "api"),
        ("api_key.create", made.key.prefix, prefix, "api"),
        ("api_key.revoke", made.key.prefix, prefix, "api"),
        ("quota.set", "alice", "", "admin-command"),
        ("session.close", session, prefix, "api"),
    ]
    entries = {e.action: e for e in audit(audit_stack, key)}
    assert entries["checkpoint.ttl"].details["ttl_seconds"] == "3600"
    assert entries["quota.set"].details == {"max_training_runs": "9"}
    assert {e.tenant for e in entries.values()} == {"alice"}
    # a key revoked through the API stops at once (the scheduler drops it from its key cache)
    assert code_of(fresh.GetUsage, service_pb2.GetUsageRequest(), fresh_md) == grpc.StatusCode.UNAUTHENTICATED
    # the admin command prints the same entries
    printed = admin_command(audit_stack, "audit-log", "--tenant", "alice", "--since", "1h", "--action", "checkpoint.publish")
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.strip().splitlines()
    assert len(lines) == 2 and "checkpoint.publish" in lines[1] and path in lines[1] and prefix in lines[1]


def test_a_refused_call_leaves_no_entry(audit_stack, tiny_model_dir):
    with audit_stack.client("carl") as carl:
        run = carl.create_lora_training_client(tiny_model_dir, rank=4, seed=2)
        path = run.save_weights_for_sampler("mine").result().path
        carls_key = audit_stack.key_for("carl")
        dora, md = stub(audit_stack, audit_stack.key_for("dora"))
        before = len(audit(audit_stack, audit_stack.admin_key))
        refusals = [
            (dora.UpdateCheckpoint, service_pb2.UpdateCheckpointRequest(path=path, published=True), grpc.StatusCode.NOT_FOUND),
            (dora.UpdateCheckpoint, service_pb2.UpdateCheckpointRequest(path=path, ttl_seconds=60), grpc.StatusCode.NOT_FOUND),
            (dora.DeleteCheckpoint, service_pb2.DeleteCheckpointRequest(path=path), grpc.StatusCode.NOT_FOUND),
            (dora.CloseSession, service_pb2.CloseSessionRequest(session_id=carl.session_id), grpc.StatusCode.NOT_FOUND),
            (dora.RevokeApiKey, service_pb2.RevokeApiKeyRequest(key=carls_key[:12]), grpc.StatusCode.NOT_FOUND),
            (dora.RevokeApiKey, service_pb2.RevokeApiKeyRequest(key=carls_key), grpc.StatusCode.NOT_FOUND),
            (dora.RevokeApiKey, service_pb2.RevokeApiKeyRequest(key=""), grpc.StatusCode.INVALID_ARGUMENT),
            (dora.CreateApiKey, service_pb2.CreateApiKeyRequest(is_admin=True), grpc.StatusCode.PERMISSION_DENIED),
            (dora.CreateApiKey, service_pb2.CreateApiKeyRequest(label="x" * 129), grpc.StatusCode.INVALID_ARGUMENT),
            (dora.CreateApiKey, service_pb2.CreateApiKeyRequest(label="bell\x07"), grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for call, request, code in refusals:
            assert code_of(call, request, md) == code, (request, code)
        mine, mine_md = stub(audit_stack, carls_key)
        for request in (service_pb2.UpdateCheckpointRequest(path=path, ttl_seconds=-1),
                        service_pb2.UpdateCheckpointRequest(path=path + "x", published=True)):
            assert code_of(mine.UpdateCheckpoint, request, mine_md) != grpc.StatusCode.OK, request
        assert len(audit(audit_stack, audit_stack.admin_key)) == before
        assert not carl.list_checkpoints(run.model_id)[0].public
        assert [k.revoked_unix_ms for k in mine.ListApiKeys(service_pb2.ListApiKeysRequest(), metadata=mine_md).keys] == [0]


def test_tenants_see_their_own_entries_and_keys_an_admin_everything(audit_stack):
    for tenant in ("erin", "fred"):
        with audit_stack.client(tenant):
            pass
    erin_key, fred_key, admin = audit_stack.key_for("erin"), audit_stack.key_for("fred"), audit_stack.admin_key
    assert {e.tenant for e in audit(audit_stack, erin_key)} == {"erin"}
    assert {e.tenant for e in audit(audit_stack, fred_key)} == {"fred"}
    assert {"erin", "fred", "ops"} <= {e.tenant for e in audit(audit_stack, admin)}
    assert {e.tenant for e in audit(audit_stack, admin, tenant="erin")} == {"erin"}
    erin, md = stub(audit_stack, erin_key)
    assert code_of(erin.GetAuditLog, service_pb2.GetAuditLogRequest(tenant="fred"), md) == grpc.StatusCode.PERMISSION_DENIED
    for bad in (service_pb2.GetAuditLogRequest(page_size=1001), service_pb2.GetAuditLogRequest(page_token="abc"),
                service_pb2.GetAuditLogRequest(action="drop"), service_pb2.GetAuditLogRequest(from_unix_ms=-1),
                service_pb2.GetAuditLogRequest(from_unix_ms=2, to_unix_ms=1)):
        assert code_of(erin.GetAuditLog, bad, md) == grpc.StatusCode.INVALID_ARGUMENT, bad
    # paging: newest first, each entry once
    whole = audit(audit_stack, admin)
    ops, ops_md = stub(audit_stack, admin)
    paged, token = [], ""
    while True:
        page = ops.GetAuditLog(service_pb2.GetAuditLogRequest(page_size=3, page_token=token), metadata=ops_md)
        paged.extend(page.entries)
        if not page.next_page_token:
            break
        token = page.next_page_token
    assert [e.id for e in paged] == [e.id for e in whole]
    # keys: the caller's tenant only, and which one is the caller's
    listed = erin.ListApiKeys(service_pb2.ListApiKeysRequest(), metadata=md)
    assert {k.tenant for k in listed.keys} == {"erin"} and listed.caller.prefix == erin_key[:12] and not listed.caller.is_admin
    assert ops.ListApiKeys(service_pb2.ListApiKeysRequest(), metadata=ops_md).caller.is_admin


def test_cluster_status_is_for_admin_keys_only(audit_stack, tiny_model_dir):
    with audit_stack.client("gina") as gina:
        run = gina.create_lora_training_client(tiny_model_dir, rank=4, seed=3)
        run.forward_backward([sft_datum([4, 8, 15, 16, 23, 42])]).result()
        tenant, md = stub(audit_stack, audit_stack.key_for("gina"))
        assert code_of(tenant.GetClusterStatus, service_pb2.GetClusterStatusRequest(), md) == grpc.StatusCode.PERMISSION_DENIED
        ops, ops_md = stub(audit_stack, audit_stack.admin_key)
        status = ops.GetClusterStatus(service_pb2.GetClusterStatusRequest(), metadata=ops_md)
        trainers = [w for w in status.workers if w.role == "trainer"]
        samplers = [w for w in status.workers if w.role == "sampler"]
        assert len(trainers) == 1 and len(samplers) == 1
        trainer = trainers[0]
        assert trainer.state == "up" and trainer.incarnation and trainer.base_model == tiny_model_dir
        assert trainer.runs_placed >= 1 and 0 < trainer.memory_used_bytes < trainer.memory_capacity_bytes
        assert samplers[0].state == "up" and samplers[0].address == audit_stack.service("sampler").address
        assert [lane.trainer_address for lane in status.lanes] == [trainer.address]
        assert status.lanes[0].cycles_total >= 1 and status.lanes[0].cycles_per_minute >= 1
        assert "gina" in {s.tenant for s in status.fair_share}
        assert all(s.weight == 1.0 for s in status.fair_share)
        assert abs(time.time() * 1000 - status.at_unix_ms) < 60_000


def test_the_sdk_reads_the_audit_log_through_the_gateway(audit_stack, monkeypatch):
    import tinker

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with audit_stack.client("hana") as hana:
        session = hana.session_id
    admin = tinker.AdminClient(base_url=audit_stack.gateway_url, api_key=audit_stack.key_for("hana"))
    entries = admin.get_audit_log().result().entries
    prefix = audit_stack.key_for("hana")[:12]
    assert [(e.event, e.event_details["target"]) for e in entries] == [("api_key_create", prefix), ("session_open", session),
                                                                       ("session_close", session)]
    assert entries[0].timestamp <= entries[1].timestamp <= entries[2].timestamp
    assert {e.event_details["tenant"] for e in entries} == {"hana"}
    assert entries[1].event_details["key_prefix"] == prefix and entries[0].event_details["actor"] == "admin-command"
    assert [e.event for e in admin.get_audit_log(event_type="organizations").result().entries] == ["api_key_create"]
    assert admin.get_audit_log(event_type="checkpoints").result().entries == []
    assert admin.get_audit_log(event_type="projects").result().entries == []
    from datetime import date
    assert admin.get_audit_log(day=date(2001, 1, 1)).result().entries == []
    import httpx
    bad = httpx.get(f"{audit_stack.gateway_url}/api/v1/audit", params={"day": "yesterday"},
                    headers={"X-API-Key": audit_stack.key_for("hana")})
    assert bad.status_code == 400 and "YYYY-MM-DD" in bad.text


def test_a_change_resent_under_its_idempotency_key_happens_and_is_logged_once(audit_stack, tiny_model_dir):
    """The SDK resends a call whose answer it lost under the same X-Idempotency-Key (services/gateway/idempotent.py)."""
    import httpx

    key = audit_stack.key_for("kim")
    kim = audit_stack.client("kim")
    path = kim.create_lora_training_client(tiny_model_dir, rank=4, seed=2).save_weights_for_sampler("w").result().path
    run, kind, name = path.removeprefix("tinker://").split("/", 2)
    route = f"{audit_stack.gateway_url}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}"

    def send(method: str, suffix: str, idempotency: str, **body):
        return httpx.request(method, route + suffix, json=body or None, timeout=30,
                             headers={"X-API-Key": key, "X-Idempotency-Key": idempotency})

    answers = [send("PUT", "/ttl", "stainless-python-retry-a", ttl_seconds=3600) for _ in range(2)]
    answers.append(send("PUT", "/ttl", "stainless-python-retry-b", ttl_seconds=3600))  # a new request: a new change
    answers += [send("DELETE", "", "stainless-python-retry-c") for _ in range(2)]  # the resend finds it done, not 404
    assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
    assert send("DELETE", "", "stainless-python-retry-d").status_code == 404  # a new delete of a deleted checkpoint
    kim.close()
    actions = [e.action for e in reversed(audit(audit_stack, key)) if e.target == path]
    assert actions == ["checkpoint.save", "checkpoint.ttl", "checkpoint.ttl", "checkpoint.delete"]
