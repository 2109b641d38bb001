"""Downloads through the unmodified tinker SDK (issue 33, item 1), on one gateway stack:

- ``save_weights_external`` saves tinker://<run>/external_weights/<name> (listed as "external",
  its TTL kept) through the run's seq order; ``get_external_weights_urls`` answers one signed URL per
  file; plain GETs of them (no key) are a peft adapter that, loaded on the base model, gives the
  trainer's own logprobs.
- Tampered, re-targeted, tokenless and expired URLs are 403; a deleted checkpoint's URLs are 404;
  another tenant asking for URLs is 404 until the owner publishes; a sampler path is 400; age
  encryption is refused 400. No refusal changes anything: the run goes on, the files still download.
"""

import json
import time
from datetime import datetime, timezone

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)
peft = pytest.importorskip("peft")

import torch  # noqa: E402
from tinker import types as tt  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from fixtures_stack import plain_get, sdk_rest_client, tinker_sdk_env  # noqa: E402
from temper.localstack import LocalStack  # noqa: E402

URL_SECONDS = 6  # signed URLs of this stack expire this soon, so expiry is seen within the test
FILES = {"adapter_config.json", "adapter_model.safetensors"}
TOKENS = [[5, 17, 42, 9, 77, 3, 18, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_sdk_external")
    env = {"TEMPER_SCHEDULER_DOWNLOAD_URL_SECONDS": str(URL_SECONDS)}
    with LocalStack(tiny_model_dir, tmp_path_factory.mktemp("sdk-external"), database_url=url, num_threads=1, gateway=True,
                    extra_env=env) as local:
        local.start()
        yield local


@pytest.fixture(scope="module")
def sdk(stack):
    with tinker_sdk_env(stack):
        client = tinker.ServiceClient()
        try:
            yield client
        finally:
            client.close("success")


def data():
    return [tt.Datum(model_input=tt.ModelInput.from_ints(t[:-1]),
                     loss_fn_inputs={"target_tokens": np.asarray(t[1:], np.int64), "weights": np.ones(len(t) - 1, np.float32)})
            for t in TOKENS]






def with_query(url: str, token: str) -> str:
    return url.split("?token=")[0] + "?token=" + token


def test_an_external_save_downloads_as_a_peft_adapter_of_the_trainers_weights(stack, sdk, tiny_model_dir, tmp_path):
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=3).result()
    tc.forward_backward(data(), "cross_entropy").result()
    tc.optim_step(tt.AdamParams(learning_rate=5e-2, eps=1e-8)).result()
    with pytest.raises(tinker.RequestFailedError, match="INVALID_ARGUMENT: age_encryption_recipients is not supported"):
        tc.save_weights_external("sealed", age_encryption_recipients=["age1xyz"]).result()
    saved = tc.save_weights_external("out", ttl_seconds=7200).result()
    assert saved.path == f"tinker://{tc.model_id}/external_weights/out"
    logprobs = [o["logprobs"].to_numpy() for o in tc.forward(data(), "cross_entropy").result().loss_fn_outputs]
    client = sdk_rest_client(stack)
    listed = {c.checkpoint_id: c for c in client.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(listed) == {"external_weights/out"}  # the refused save left nothing
    external = listed["external_weights/out"]
    assert external.checkpoint_type == "external" and external.tinker_path == saved.path
    assert 7100 < (external.expires_at - external.time).total_seconds() <= 7200

    answer = client.get_external_weights_urls(saved.path).result()
    assert set(answer.urls) == FILES
    assert 0 < (answer.expires - datetime.now(timezone.utc)).total_seconds() <= URL_SECONDS
    for relpath, url in answer.urls.items():
        assert url.startswith(f"{stack.gateway_url}/api/v1/external_weights/")
        status, headers, body = plain_get(url)  # no key: the signature is the credential
        assert status == 200, body
        assert int(headers["Content-Length"]) == len(body) > 0
        assert headers["Content-Type"].startswith("application/json" if relpath.endswith(".json") else "application/octet-stream")
        (tmp_path / relpath).write_bytes(body)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path)).eval()
    with torch.no_grad():
        for tokens, trainer_logprobs in zip(TOKENS, logprobs):
            logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
            mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
            np.testing.assert_allclose(mine, trainer_logprobs, atol=2e-4, rtol=1e-4)
    # the adapter really is trained: the base model alone gives other logprobs
    with torch.no_grad(), model.disable_adapter():
        base = torch.log_softmax(model(input_ids=torch.tensor([TOKENS[0][:-1]])).logits[0].float(), -1)
    assert not np.allclose(base.gather(-1, torch.tensor(TOKENS[0][1:])[:, None])[:, 0].numpy(), logprobs[0], atol=1e-3)


def test_bad_urls_are_403_deleted_is_404_and_other_tenants_get_none(stack, sdk, tiny_model_dir):
    tc = sdk.create_lora_training_client(tiny_model_dir, rank=4, seed=4).result()
    path = tc.save_weights_external("kept").result().path
    gone = tc.save_weights_external("gone").result().path
    sampler = tc.save_weights_for_sampler("samp").result().path
    owner = sdk_rest_client(stack)
    signed = owner.get_external_weights_urls(path).result()
    urls = signed.urls
    config, weights = urls["adapter_config.json"], urls["adapter_model.safetensors"]
    token = config.split("?token=")[1]

    assert plain_get(config[:-1] + ("A" if config[-1] != "A" else "B"))[0] == 403            # tampered signature
    assert plain_get(with_query(weights, token))[0] == 403                                 # another file's token
    assert plain_get(config.replace("/kept/", "/gone/"))[0] == 403                         # another checkpoint
    assert plain_get(config.split("?")[0])[0] == 403                                       # no token
    assert plain_get(with_query(config, token.replace("v1.", "v1.x", 1)))[0] == 403         # unknown key
    assert plain_get(config)[0] == 200 and plain_get(weights)[0] == 200  # the refusals changed nothing: the URLs still open

    other = sdk_rest_client(stack, stack.key_for("external-other"))
    with pytest.raises(tinker.NotFoundError):
        other.get_external_weights_urls(path).result()
    owner.publish_checkpoint_from_tinker_path(path).result()
    others_urls = other.get_external_weights_urls(path).result().urls
    assert set(others_urls) == FILES and plain_get(others_urls["adapter_config.json"])[0] == 200  # published: anyone may download
    owner.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_external_weights_urls(path).result()
    assert plain_get(others_urls["adapter_config.json"])[0] == 404  # unpublished: the other tenant's URLs stop at once
    assert plain_get(config)[0] == 200  # the owner's still open
    run, name = sampler.split("/")[2], sampler.split("/")[-1]
    status, _, body = plain_get(f"{stack.gateway_url}/api/v1/training_runs/{run}/checkpoints/sampler_weights/{name}/external_weights_urls",
                          stack.api_key)
    assert status == 400 and b"only external_weights" in body

    gone_urls = owner.get_external_weights_urls(gone).result().urls
    owner.delete_checkpoint_from_tinker_path(gone).result()
    assert plain_get(gone_urls["adapter_config.json"])[0] == 404

    tc.forward_backward(data(), "cross_entropy").result()  # the run still takes its verbs in order
    # expiry: the same URLs, once past their time, are 403
    time.sleep(max(0.0, (signed.expires - datetime.now(timezone.utc)).total_seconds()) + 0.5)
    assert plain_get(config)[0] == 403 and plain_get(weights)[0] == 403
