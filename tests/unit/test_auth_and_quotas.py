"""Tenancy pieces without a model or a network: API-key authentication (cache, refusals, the
disabled mode, open methods), the one-minute token windows, and rate-limited work that waits in the
queue instead of failing while another tenant's work goes on."""

from __future__ import annotations

import asyncio

import pytest

from fakes_scheduler import FakeStore, build, fb
from temper.common.errors import ResourceExhausted, Unauthenticated
from temper.scheduler.db import keys
from temper.scheduler.tenancy.auth import LOCAL_TENANT, ApiKeyAuth, caller
from temper.scheduler.tenancy.quotas import TokenWindow, check_hard_limit
from temper.scheduler.planning.work import WorkKind


class Context:
    def __init__(self, metadata=()):
        self.metadata = list(metadata)

    def invocation_metadata(self):
        return self.metadata


class KeyStore:
    def __init__(self):
        self.valid = {"tml-alice-key": "alice"}
        self.lookups = 0

    def tenant_for_key(self, key):
        self.lookups += 1
        if key == "tml-revoked":
            raise Unauthenticated("API key tml-revoked… was revoked")
        if key not in self.valid:
            raise Unauthenticated("unknown API key")
        return self.valid[key]

    def key_identity(self, key):
        from temper.scheduler.db.tenancy import KeyIdentity
        return KeyIdentity(self.tenant_for_key(key), 0, key[:12], False)


def authenticate(auth: ApiKeyAuth, metadata, method="/temper.v1.Temper/GetUsage") -> str:
    async def main():
        await auth(method, Context(metadata))
        return caller()

    return asyncio.run(main())


def test_the_tenant_comes_from_the_key_and_is_cached():
    store = KeyStore()
    auth = ApiKeyAuth(store, cache_seconds=60)
    assert authenticate(auth, [("authorization", "Bearer tml-alice-key")]) == "alice"
    assert authenticate(auth, [("authorization", "bearer tml-alice-key")]) == "alice"
    assert store.lookups == 1  # the second call came from the cache
    # a header claiming a tenant changes nothing
    assert authenticate(auth, [("x-temper-tenant", "bob"), ("authorization", "Bearer tml-alice-key")]) == "alice"


@pytest.mark.parametrize("metadata, message", [
    ([], "no API key"), ([("authorization", "tml-alice-key")], "no API key"), ([("authorization", "Bearer ")], "no API key"),
    ([("authorization", "Bearer sk-other")], "start with 'tml-'"), ([("authorization", "Bearer tml-nope")], "unknown API key"),
    ([("authorization", "Bearer tml-revoked")], "revoked"),
])
def test_missing_unknown_and_revoked_keys_are_unauthenticated(metadata, message):
    with pytest.raises(Unauthenticated, match=message):
        authenticate(ApiKeyAuth(KeyStore()), metadata)


def test_an_unknown_key_is_remembered_briefly_and_a_revocation_is_seen_after_the_cache_time():
    store = KeyStore()
    auth = ApiKeyAuth(store, cache_seconds=0.0)
    for _ in range(3):
        with pytest.raises(Unauthenticated):
            authenticate(auth, [("authorization", "Bearer tml-nope")])
    assert store.lookups == 1  # guessing costs no database queries
    assert authenticate(auth, [("authorization", "Bearer tml-alice-key")]) == "alice"
    del store.valid["tml-alice-key"]
    with pytest.raises(Unauthenticated):  # cache_seconds = 0: looked up again
        authenticate(auth, [("authorization", "Bearer tml-alice-key")])


def test_health_is_open_and_disabled_auth_is_one_local_tenant():
    store = KeyStore()
    asyncio.run(ApiKeyAuth(store)("/grpc.health.v1.Health/Check", Context()))
    assert store.lookups == 0
    assert authenticate(ApiKeyAuth(store, mode="disabled"), []) == LOCAL_TENANT


def test_keys_are_random_prefixed_and_stored_as_digests():
    a, b = keys.new_key(), keys.new_key()
    assert a != b and a.startswith("tml-") and len(a) >= 40
    assert keys.digest(a) != keys.digest(b) and len(keys.digest(a)) == 64 and a not in keys.digest(a)
    assert keys.prefix(a) == a[:12]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_token_window_measures_the_last_minute_and_says_how_long_to_wait():
    clock = Clock()
    window = TokenWindow(clock)
    window.record("a", 100)
    clock.now += 30
    window.record("a", 50)
    clock.now += 1
    assert window.used("a") == 150 and window.wait_seconds("a", 0) == 0.0
    assert window.wait_seconds("a", 200) == 0.0
    assert window.wait_seconds("a", 120) == pytest.approx(29.0)  # when the 100 tokens age out
    assert window.wait_seconds("a", 40) == pytest.approx(59.0)   # both must age out
    clock.now += 29
    assert window.used("a") == 50 and window.wait_seconds("a", 120) == 0.0


def test_hard_limits_name_the_limit_and_the_use():
    check_hard_limit("max_training_runs", 0, 10**6)  # 0: unlimited
    check_hard_limit("max_training_runs", 3, 2)
    with pytest.raises(ResourceExhausted, match=r"max_training_runs = 3 reached \(in use: 3\)"):
        check_hard_limit("max_training_runs", 3, 3)


def test_work_over_a_tenants_rate_waits_in_the_queue_while_others_run():
    async def main():
        store = FakeStore()
        store.add_run("ra", "alice")
        store.add_run("rb", "bob")
        store.limits["alice"] = {"train_tokens_per_minute": 3}
        s = build(store)
        clock = Clock()
        s.admission.quotas.trained.clock = clock
        task = asyncio.create_task(s.loop.run_forever())
        try:
            await s.admission.submit("ra", 1, WorkKind.FORWARD_BACKWARD, fb("ra", 1), lambda run: 3, tenant="alice")
            waiting = asyncio.ensure_future(s.admission.submit("ra", 2, WorkKind.FORWARD_BACKWARD, fb("ra", 2), lambda run: 3, tenant="alice"))
            await s.admission.submit("rb", 1, WorkKind.FORWARD_BACKWARD, fb("rb", 1), tenant="bob")  # bob is not held up
            await asyncio.sleep(0.2)
            assert not waiting.done() and store.statuses("ra") == {1: "done", 2: "queued"}
            assert s.admission.quotas.train_wait("alice") == pytest.approx(60.0)
            clock.now += 61  # alice's minute has passed
            s.admission.wake.set()
            await asyncio.wait_for(waiting, 5)
            assert store.statuses("ra") == {1: "done", 2: "done"}
        finally:
            task.cancel()

    asyncio.run(main())


def test_sampling_over_a_tenants_rate_waits_until_its_minute_is_under_the_limit():
    async def main():
        store = FakeStore()
        store.limits["alice"] = {"sample_tokens_per_minute": 10}
        quotas = build(store).admission.quotas
        clock = Clock()
        quotas.sampled.clock = clock
        await quotas.wait_to_sample("alice")  # under the limit: no wait
        quotas.sampled.record("alice", 10)
        await quotas.wait_to_sample("bob")  # others are not held up
        waiting = asyncio.ensure_future(quotas.wait_to_sample("alice"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        clock.now += 60
        await asyncio.wait_for(waiting, 5)

    asyncio.run(main())
