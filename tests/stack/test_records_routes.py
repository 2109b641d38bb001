"""The SDK routes over what the scheduler keeps, through the gateway with the unmodified ``tinker``
SDK: RestClient.list_sessions / get_session, AdminClient.get_current_checkpoint_storage_usage, and
GET /api/v1/whoami for an API key. A tenant sees only its own; bad query values answer 400 and
another tenant's session 404."""

from __future__ import annotations

import httpx
import pytest

from fixtures_stack import sft_datum
from temper.client import AdamParams


@pytest.fixture(scope="module")
def gw_stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    from temper.localstack import LocalStack

    url = new_postgres_database("temper_records_routes")
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("records"), database_url=url, num_threads=1, gateway=True) as local:
        local.address = local.start()
        yield local


def test_sessions_storage_and_whoami_through_the_sdk(gw_stack, tiny_model_dir):
    import tinker

    mine, theirs = gw_stack.client("ada"), gw_stack.client("bo")
    run = mine.create_lora_training_client(tiny_model_dir, rank=4, seed=1)
    run.forward_backward([sft_datum([3, 8, 13, 21, 34])], "cross_entropy").result()
    run.optim_step(AdamParams(learning_rate=1e-3)).result()
    saved = run.save_weights_for_sampler("s1").result()
    sampler = mine.create_sampling_client(model_path=saved.path)
    theirs.create_lora_training_client(tiny_model_dir, rank=4, seed=2)

    key = gw_stack.key_for("ada")
    service = tinker.ServiceClient(base_url=gw_stack.gateway_url, api_key=key)
    rest = service.create_rest_client()
    listed = rest.list_sessions(limit=50).result()
    assert mine.session_id in listed.sessions and theirs.session_id not in listed.sessions
    session = rest.get_session(mine.session_id).result()
    assert run.model_id in session.training_run_ids and sampler.sampler_id in session.sampler_ids
    with pytest.raises(tinker.NotFoundError):
        rest.get_session(theirs.session_id).result()

    usage = tinker.AdminClient(base_url=gw_stack.gateway_url, api_key=key).get_current_checkpoint_storage_usage().result()
    (item,) = usage.data
    assert item.checkpoint_count == 1 and item.size_bytes > 0

    headers = {"Authorization": f"Bearer {key}"}
    me = httpx.get(f"{gw_stack.gateway_url}/api/v1/whoami", headers=headers, timeout=30).json()
    assert me["tenant"] == "ada" and key.startswith(me["key_prefix"]) and me["org_urn"] == "temper:tenant:ada"
    for params in ({"limit": "-1"}, {"limit": "x"}, {"offset": "1" * 20}, {"access_scope": "everyone"}):
        bad = httpx.get(f"{gw_stack.gateway_url}/api/v1/sessions", params=params, headers=headers, timeout=30)
        assert bad.status_code == 400, (params, bad.text)
    assert httpx.get(f"{gw_stack.gateway_url}/api/v1/whoami", timeout=30).status_code == 401
    mine.close()
    theirs.close()
