"""Dense to mixture-of-experts is one string: one stack serves the tiny dense model (qwen3) and the
tiny MoE model (qwen3_moe, 8 experts top-2) side by side, one trainer and one sampler each, the
gateway in front. The same unmodified tinker SDK loop runs on both; only the base model name differs.
On the MoE model the adapter trains the routed experts (peft target_parameters on the fused tensors)."""

from __future__ import annotations

import json
import warnings

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

tinker = pytest.importorskip("tinker")  # the `gateway` extra (make venv installs it)

from tinker import types as tt  # noqa: E402

from temper.localstack import LocalStack  # noqa: E402

RANK = 8
ADAM = dict(learning_rate=1e-2, eps=1e-8)
TOKENS = [[5, 17, 42, 9, 77, 3, 18, 5, 17], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
EXPERT_TARGETS = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}


class TwoModelStack(LocalStack):
    """A LocalStack whose second trainer and second sampler ("trainer-1", "sampler-1") serve
    ``second_model``; the first ones serve ``base_model``."""

    def __init__(self, base_model: str, second_model: str, data_dir, **kwargs):
        super().__init__(base_model, data_dir, num_trainers=2, num_samplers=2, **kwargs)
        self.second_model = second_model

    def _worker_env(self, role: str, name: str) -> dict[str, str]:
        env = super()._worker_env(role, name)
        if name.endswith("-1"):
            env[f"TEMPER_{role.upper()}_BASE_MODEL"] = self.second_model
        return env


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    from temper.services.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-moe", family="qwen3_moe"))


@pytest.fixture(scope="module")
def two_model_stack(tiny_model_dir, moe_model_dir, new_postgres_database, tmp_path_factory):
    url = new_postgres_database("temper_moe_sdk")
    with TwoModelStack(tiny_model_dir, moe_model_dir, tmp_path_factory.mktemp("moe-sdk"), database_url=url,
                       num_threads=1, gateway=True) as local:
        local.start()
        yield local


def datum(tokens: list[int]) -> tt.Datum:
    n = len(tokens) - 1
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(n, np.float32)})


def run_loop(service_client, base_model: str) -> dict:
    """The user's SFT loop, word for word the same for every base model."""
    data = [datum(t) for t in TOKENS]
    tc = service_client.create_lora_training_client(base_model=base_model, rank=RANK, seed=1).result()
    losses = []
    for _ in range(3):
        fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(tt.AdamParams(**ADAM))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    after = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]

    sampler_path = tc.save_weights_for_sampler("final").result().path
    sc = service_client.create_sampling_client(model_path=sampler_path).result()
    prompt = tt.ModelInput.from_ints(TOKENS[0][:4])
    params = tt.SamplingParams(max_tokens=4, temperature=0.7, seed=3, stop=[])
    samples = sc.sample(prompt, num_samples=2, sampling_params=params).result()
    logprobs = sc.compute_logprobs(prompt).result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    again = snapshot.sample(prompt, num_samples=2, sampling_params=params).result()

    state = tc.save_state("step3").result().path
    tc.forward_backward(data, "cross_entropy").result()  # move away from step 3 ...
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    moved = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    tc.load_state(state).result()  # ... and back
    resumed = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    fresh = service_client.create_training_client_from_state_with_optimizer(state).result()  # the SDK's newer way
    from_state = fresh.forward(data, "cross_entropy").result().metrics["loss:sum"]
    return dict(tc=tc, info=tc.get_info(), losses=losses, after=after, sampler_path=sampler_path,
                sampler_base=sc.get_base_model(), samples=samples, again=again, logprobs=logprobs, state=state,
                moved=moved, resumed=resumed, fresh=fresh, from_state=from_state)


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")  # the SDK still serves it
def test_dense_and_moe_run_the_same_sdk_loop(two_model_stack, tiny_model_dir, moe_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service_client = tinker.ServiceClient(base_url=two_model_stack.gateway_url, api_key=two_model_stack.api_key)
    try:
        with warnings.catch_warnings():  # deprecated by newer SDKs in favour of RestClient's (below), still served
            warnings.simplefilter("ignore", FutureWarning)
            served = {m.model_name: m for m in service_client.get_server_capabilities().supported_models}
        assert {tiny_model_dir, moe_model_dir} <= set(served)
        assert all(served[m].trainable and served[m].sampleable for m in (tiny_model_dir, moe_model_dir))
        rest = tinker.RestClient(base_url=two_model_stack.gateway_url, api_key=two_model_stack.api_key)
        assert {tiny_model_dir, moe_model_dir} <= {m.model_name for m in rest.get_server_capabilities().result().supported_models}
        results = {name: run_loop(service_client, name) for name in (tiny_model_dir, moe_model_dir)}
    finally:
        service_client.close("success")

    for base_model, r in results.items():
        losses = r["losses"]
        assert all(np.isfinite(losses)), (base_model, losses)
        assert losses[0] > losses[1] > losses[2] > r["after"], (base_model, losses, r["after"])
        assert r["info"].model_data.model_name == base_model
        assert r["sampler_base"] == base_model
        assert r["sampler_path"] == f"tinker://{r['tc'].model_id}/sampler_weights/final"
        assert len(r["samples"].sequences) == 2 and all(len(s.tokens) == 4 for s in r["samples"].sequences)
        assert [s.tokens for s in r["again"].sequences] == [s.tokens for s in r["samples"].sequences]  # same weights, seed
        assert r["logprobs"][0] is None and len(r["logprobs"]) == 4 and all(np.isfinite(r["logprobs"][1:]))
        assert r["state"] == f"tinker://{r['tc'].model_id}/weights/step3"
        assert r["moved"] != r["after"] and r["resumed"] == r["after"], (base_model, r["moved"], r["after"], r["resumed"])
        assert r["fresh"].model_id != r["tc"].model_id and r["from_state"] == r["after"]
        assert r["fresh"].get_info().model_data.model_name == base_model

    # the model's family, experts and rank per expert: ModelData.arch in the SDK's types; the counts in
    # the JSON of get_info and list_training_runs (the SDK's pydantic types keep only their own fields)
    # and on the console's run page
    moe_id, dense_id = results[moe_model_dir]["tc"].model_id, results[tiny_model_dir]["tc"].model_id
    assert results[moe_model_dir]["info"].model_data.arch == "qwen3_moe"
    assert results[tiny_model_dir]["info"].model_data.arch == "qwen3"
    listed = {r.training_run_id: r for r in rest.list_training_runs(limit=100).result().training_runs}
    assert listed[moe_id].lora_rank == RANK and listed[moe_id].base_model == moe_model_dir
    headers = {"X-API-Key": two_model_stack.api_key}
    base = two_model_stack.gateway_url
    moe_shape = {"num_experts": 8, "num_experts_per_tok": 2, "expert_rank": RANK // 2}
    info_json = httpx.post(f"{base}/api/v1/get_info", json={"model_id": moe_id}, headers=headers, timeout=30).json()
    assert info_json["model_data"] == {**info_json["model_data"], "arch": "qwen3_moe", **moe_shape}
    dense_json = httpx.post(f"{base}/api/v1/get_info", json={"model_id": dense_id}, headers=headers, timeout=30).json()
    assert dense_json["model_data"]["arch"] == "qwen3" and "num_experts" not in dense_json["model_data"]
    runs_json = {r["training_run_id"]: r for r in httpx.get(f"{base}/api/v1/training_runs", params={"limit": 100},
                                                               headers=headers, timeout=30).json()["training_runs"]}
    assert runs_json[moe_id] == {**runs_json[moe_id], "model_family": "qwen3_moe", **moe_shape}
    assert runs_json[dense_id]["model_family"] == "qwen3" and "num_experts" not in runs_json[dense_id]
    console_run = httpx.get(f"{base}/console/api/runs/{moe_id}", headers=headers, timeout=30).json()["run"]
    assert (console_run["family"], console_run["num_experts"], console_run["num_experts_per_tok"],
            console_run["lora_config"]["expert_rank"]) == ("qwen3_moe", 8, 2, RANK // 2)

    # Temper's own gRPC: the saved adapters, as peft folders
    with two_model_stack.client() as ours:
        def adapter(base_model):
            path = results[base_model]["sampler_path"]
            folder = ours.download_checkpoint(path, tmp_path / base_model.strip("/").replace("/", "_"))
            return json.loads((folder / "adapter_config.json").read_text()), load_file(str(folder / "adapter_model.safetensors"))

        moe_config, moe_weights = adapter(moe_model_dir)
        dense_config, dense_weights = adapter(tiny_model_dir)

    assert moe_config["base_model_name_or_path"] == moe_model_dir and moe_config["r"] == RANK
    assert EXPERT_TARGETS <= set(moe_config["target_parameters"]), moe_config
    assert moe_config["rank_pattern"] == {t: RANK // 2 for t in EXPERT_TARGETS}  # rank spread over the top-2 experts
    # peft's nested ParamWrappers on each layer's fused experts: gate_up_proj's LoRA (experts.base_layer.lora_*)
    # and down_proj's (experts.lora_*), every expert's rank-4 factors stacked (rank * experts rows / columns)
    for layer in range(2):
        experts = {k.split(".mlp.experts.")[1]: v for k, v in moe_weights.items() if f"layers.{layer}.mlp.experts." in k}
        assert sorted(experts) == ["base_layer.lora_A.weight", "base_layer.lora_B.weight", "lora_A.weight", "lora_B.weight"]
        assert experts["base_layer.lora_A.weight"].shape == (RANK // 2 * 8, 64)  # gate_up: in = hidden
        assert experts["lora_A.weight"].shape == (RANK // 2 * 8, 32)  # down: in = moe_intermediate
        for name in ("base_layer.lora_B.weight", "lora_B.weight"):  # B starts at zero: trained
            assert np.abs(experts[name]).max() > 0, (layer, name)
    assert dense_config["base_model_name_or_path"] == tiny_model_dir and dense_config["r"] == RANK
    assert not dense_config.get("target_parameters") and not any(".experts." in k for k in dense_weights)
