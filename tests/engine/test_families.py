"""Every model family Temper trains (services/models/families.py), on its tiny random model: the same
matrix for each of llama, qwen3, qwen3_moe, gpt_oss and deepseek_v3.

  1. training with every loss (losses move, gradients land, routed-expert LoRA moves on MoE models)
  2. sampling and prompt logprobs on the torch sampler backend with the trained adapter saved and loaded
  3. a training checkpoint with its optimizer resumes in a fresh engine exactly (fp32)
  4. the saved adapter folder goes back in through the import path, and samples as the original
  5. co-batched two-tenant cycles equal each tenant alone (fp32)
  6. the sampler's logprobs equal the trainer's, and a decode batch mixing adapters equals each alone

plus: a model of no known family takes no adapter (INVALID_ARGUMENT naming it, nothing created), and an
MoE adapter that asked for the MLP always adapts the routed experts.

Every family's model and engine are built once (module-scoped fixtures); sequences are short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from temper.common.errors import InvalidArgument
from temper.common.validation import LOSS_SPECS, DecodedDatum
from temper.services.lora.model import EXPERT_TARGETS, AdapterSpec
from temper.services.models.families import family_of
from temper.services.models.loading import load_model
from temper.services.models.tiny import TINY_FAMILIES
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.services.trainer import convert, imports
from temper.services.trainer.engine import AdamParams, ForwardBackwardItem, OptimStepItem, TrainerEngine
from temper.services.trainer.losses import LOSS_FNS
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, types_pb2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")
MOE = {"qwen3_moe", "gpt_oss", "deepseek_v3"}
TOP_K = 2            # the tiny MoE models route every token to 2 of 8 experts
NUM_EXPERTS = 8
VOCAB = 512
TOL = 1e-5           # fp32 equalities of the matrix
ADAM = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
GREEDY = SamplingOptions(max_tokens=6, temperature=0.0, stop_disabled=True)
SEEDED = SamplingOptions(max_tokens=6, temperature=1.0, seed=11, stop_disabled=True)
# prompts longer than gpt_oss's sliding window (8), so prefill and decode cross it
PROMPTS = [np.array(p, np.int32) for p in ([5, 17, 42, 9, 100, 3, 77, 250, 31, 8, 12], [7, 3, 100, 42, 9], [300, 11, 60])]


def test_the_matrix_covers_every_family():
    assert set(FAMILIES) == set(TINY_FAMILIES)


# ---- helpers ------------------------------------------------------------------------------------

def lora_spec(engine, rank=4, attn=True, mlp=True, unembed=True, expert_rank=0, seed=1) -> tuple[AdapterSpec, int]:
    """The spec and seed of a LoraConfig, as the servicer makes them."""
    cfg = types_pb2.LoraConfig(rank=rank, train_attn=attn, train_mlp=mlp, train_unembed=unembed, expert_rank=expert_rank,
                               seed=seed)
    return convert.adapter_from_pb(cfg, 32.0, engine.lora)


def create(engine, run_id, **kwargs):
    spec, seed = lora_spec(engine, **kwargs)
    return engine.create_adapter(run_id, spec, seed)


def token_data(seed, lengths=(7, 10)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n + 1) for n in lengths]


def sft_datum(tokens, weights=None) -> DecodedDatum:
    weights = np.ones(len(tokens) - 1, np.float32) if weights is None else np.asarray(weights, np.float32)
    return DecodedDatum(tokens=np.asarray(tokens[:-1], np.int32),
                        inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": weights})


def rl_datum(tokens, logprobs, advantages) -> DecodedDatum:
    return DecodedDatum(tokens=np.asarray(tokens[:-1], np.int32),
                        inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                "logprobs": np.asarray(logprobs, np.float32), "advantages": np.asarray(advantages, np.float32)})


def forward(engine, run_id, data, loss_fn="cross_entropy", config=None, forward_only=True):
    config = {**LOSS_SPECS[loss_fn].config, **(config or {})}
    (result,), _ = engine.run_cycle([ForwardBackwardItem(run_id, data, loss_fn, config, forward_only)], [])
    assert not isinstance(result, Exception), result
    return result


def step(engine, run_id, adam=ADAM):
    _, (metrics,) = engine.run_cycle([], [OptimStepItem(run_id, adam)])
    assert not isinstance(metrics, Exception), metrics
    return metrics


def weights_of(engine, run_id) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.host.get(run_id).params.items()}


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def perturb(engine, run_id, seed, std=0.05):
    """Non-trivial weights (B starts at 0: a fresh adapter is a no-op), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in sorted(engine.host.get(run_id).params):
            engine.host.get(run_id).params[name].normal_(0, std, generator=generator)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def quiet_load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(str(folder))


# ---- fixtures: one model, trainer engine and sampler per family ---------------------------------



@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory, family_dirs):
    family = request.param
    folder = family_dirs[family]
    root = tmp_path_factory.mktemp(f"run-{family}")
    engine = TrainerEngine(quiet_load(folder), TrainerSettings(checkpoint_dir=root / "ckpt", offload_dir=root / "offload"))
    sampler = TorchSamplerBackend(quiet_load(folder))
    assert family_of(engine.loaded.model.config).name == family
    return SimpleNamespace(name=family, folder=folder, root=root, engine=engine, sampler=sampler, moe=family in MOE)


@pytest.fixture(scope="module")
def trained(fam):
    """Two trained adapters of different layouts ("main": every group, rank 4; "other": MLP + unembedding,
    rank 8), saved and loaded into the sampler under their checkpoint keys."""
    engine = fam.engine
    create(engine, "main", seed=3)
    create(engine, "other", rank=8, attn=False, mlp=True, unembed=True, seed=4)
    data = [sft_datum(t) for t in token_data(0, (8, 12, 6))]
    for _ in range(3):
        engine.run_cycle([ForwardBackwardItem("main", data), ForwardBackwardItem("other", data[::-1])],
                         [OptimStepItem(r, dataclasses.replace(ADAM, learning_rate=3e-2)) for r in ("main", "other")])
    keys = {}
    for run_id in ("main", "other"):
        keys[run_id] = f"{run_id}/sampler_weights/s3"
        engine.save(run_id, keys[run_id], include_optimizer=False)
        fam.sampler.load_adapter(keys[run_id], engine.store.existing(keys[run_id]))
    return keys


# ---- 1. training with every loss ----------------------------------------------------------------

# gspo's default clip range (1 - 3e-4, 1 + 4e-4) clips every token once the first step has moved the sequence
# ratio, leaving the second step no gradient; a wider range keeps both steps training
LOSS_CONFIG = {"gspo": {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}}


@pytest.mark.parametrize("loss_fn", sorted(LOSS_FNS))
def test_train_every_loss(fam, loss_fn):
    engine, run_id = fam.engine, f"loss-{loss_fn}"
    create(engine, run_id, seed=5)
    raw = token_data(1)
    if loss_fn == "cross_entropy":
        data = [sft_datum(t) for t in raw]
    else:  # on-policy sampler logprobs, so every ratio starts at 1, inside any clip range
        q = forward(engine, run_id, [sft_datum(t) for t in raw]).logprobs
        rng = np.random.default_rng(2)
        data = [rl_datum(t, lp, rng.standard_normal(len(lp)) + 0.5) for t, lp in zip(raw, q)]
    config = LOSS_CONFIG.get(loss_fn)
    start = weights_of(engine, run_id)

    before = forward(engine, run_id, data, loss_fn, config, forward_only=False)
    adapter = engine.host.get(run_id)
    for name, p in adapter.params.items():  # every gradient landed, finite; B's are nonzero (A's wait for B != 0)
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if ".lora_B." in name:
            assert p.grad.abs().max() > 0, name
    assert step(engine, run_id)["step:max"] == 1
    after_one = weights_of(engine, run_id)
    for name in start:
        if ".lora_B." in name:
            assert not torch.equal(after_one[name], start[name]), name
    if fam.moe:
        expert_b = [n for n in start if is_expert(n) and ".lora_B." in n]
        assert expert_b and len(expert_b) == 2 * len(engine.lora.experts)
        for name in expert_b:  # (out, r * E), expert e in columns e, E + e, ...: most experts got tokens and moved
            out, width = start[name].shape
            moved = (after_one[name] - start[name]).view(out, width // NUM_EXPERTS, NUM_EXPERTS).abs().amax((0, 1)) > 0
            assert int(moved.sum()) >= NUM_EXPERTS // 2, (name, moved)

    after = forward(engine, run_id, data, loss_fn, config)
    assert np.isfinite(after.metrics["loss:sum"]) and after.metrics["loss:sum"] != before.metrics["loss:sum"]
    # a descent step: on cross-entropy the loss falls; every RL loss starts on-policy, where its gradient is
    # -sum(A * grad lp) (the reported value of cispo, gspo and stable_reinforce is no potential of that), so
    # the policy-gradient objective sum(A * lp) rises
    if loss_fn == "cross_entropy":
        assert after.metrics["loss:sum"] < before.metrics["loss:sum"], (before.metrics, after.metrics)
    else:
        objective = lambda result: sum(float((d.inputs["advantages"] * lp).sum()) for d, lp in zip(data, result.logprobs))  # noqa: E731
        assert objective(after) > objective(before), (objective(before), objective(after))
    forward(engine, run_id, data, loss_fn, config, forward_only=False)
    step(engine, run_id)
    for name, weight in weights_of(engine, run_id).items():  # the second step moves the A's too, experts' included
        assert not torch.equal(weight, start[name]), name
    engine.drop_adapter(run_id)


def test_moe_adapters_train_the_routed_experts_whenever_the_mlp_is_asked(fam):
    engine = fam.engine
    for attn, unembed in [(False, False), (True, False), (True, True)]:
        spec, _ = lora_spec(engine, rank=4, attn=attn, mlp=True, unembed=unembed)
        if not fam.moe:
            assert not spec.expert_targets and {"gate_proj", "up_proj", "down_proj"} <= set(spec.targets)
            continue
        assert "mlp.experts.gate_up_proj" in spec.targets and set(EXPERT_TARGETS) <= set(spec.targets), spec
        run_id = f"mlp-{attn}-{unembed}"
        adapter = engine.create_adapter(run_id, spec, 0)
        assert adapter.spec.expert_rank == 4 // TOP_K  # the default: rank // num_experts_per_tok
        for path, experts in engine.lora.experts.items():  # every MoE layer's experts, both projections
            assert run_id in experts.adapters
            names = [n for n in adapter.params if f".{path}." in n]
            assert len(names) == 4, names
            for name in names:
                if ".lora_A." in name:
                    assert adapter.params[name].shape[0] == NUM_EXPERTS * adapter.spec.expert_rank
        engine.drop_adapter(run_id)
    # an explicit expert rank is kept; the CreateAdapter RPC reports the expert rank it resolved
    if fam.moe:
        spec, _ = lora_spec(engine, rank=8, attn=False, mlp=True, unembed=False, expert_rank=3)
        assert engine.create_adapter("mlp-er3", spec, 0).spec.expert_rank == 3
        engine.drop_adapter("mlp-er3")
    from temper.services.trainer.servicer import TrainerServicer

    request = trainer_pb2.CreateAdapterRequest(training_run_id="mlp-rpc", lora_config=types_pb2.LoraConfig(
        rank=8, train_mlp=True, seed=1))
    response = asyncio.run(TrainerServicer(engine).CreateAdapter(request, None))
    assert response.expert_rank == (8 // TOP_K if fam.moe else 0)
    targets = engine.host.get("mlp-rpc").spec.targets
    assert ("mlp.experts.gate_up_proj" in targets) == fam.moe and "q_proj" not in targets
    engine.drop_adapter("mlp-rpc")
    # an attention-only config trains no MLP
    spec, _ = lora_spec(engine, rank=4, attn=True, mlp=False, unembed=False)
    assert not spec.expert_targets and not {"gate_proj", "up_proj", "down_proj"} & set(spec.targets)


# ---- 2. sampling and prompt logprobs with the trained adapter -----------------------------------

def test_sample_and_compute_logprobs_with_the_trained_adapter(fam, trained):
    sampler, key = fam.sampler, trained["main"]
    prompt = PROMPTS[0]
    result = sampler.sample(key, prompt, 2, SEEDED, True)
    assert len(result.sequences) == 2
    base_lp = sampler.compute_logprobs(None, prompt)
    lp = sampler.compute_logprobs(key, prompt)
    assert np.isnan(lp[0]) and np.isfinite(lp[1:]).all() and (lp[1:] <= 0).all()
    np.testing.assert_allclose(result.prompt_logprobs[1:], lp[1:], atol=TOL)
    assert np.abs(lp[1:] - base_lp[1:]).max() > 1e-3  # the trained adapter changes the model
    for seq in result.sequences:
        assert len(seq.tokens) == SEEDED.max_tokens and all(0 <= t < VOCAB for t in seq.tokens)
        # the KV-cached decode's logprobs are the full sequence's prompt logprobs (past the sliding window too)
        full = sampler.compute_logprobs(key, np.concatenate([prompt, np.array(seq.tokens, np.int32)]))
        np.testing.assert_allclose(seq.logprobs, full[len(prompt):], atol=1e-4)
    again = sampler.sample(key, prompt, 2, SEEDED, False)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
    last = sampler.compute_logprobs(key, prompt, last_n=3)  # the unscored positions hold NaN
    assert np.isnan(last[:-3]).all()
    np.testing.assert_allclose(last[-3:], lp[-3:], atol=TOL)


# ---- 3. save, load into a fresh engine, resume ---------------------------------------------------

def test_training_checkpoint_resumes_exactly_in_a_fresh_engine(fam):
    engine = fam.engine
    create(engine, "resume-a", seed=6)
    first = [sft_datum(t) for t in token_data(3)]
    nxt = [sft_datum(t) for t in token_data(4, (9, 5))]
    for _ in range(2):
        engine.run_cycle([ForwardBackwardItem("resume-a", first)], [OptimStepItem("resume-a", ADAM)])
    engine.save("resume-a", "resume-a/weights/s2", include_optimizer=True)

    fresh = TrainerEngine(quiet_load(fam.folder), TrainerSettings(checkpoint_dir=fam.root / "ckpt",
                                                                  offload_dir=fam.root / "offload-fresh"))
    create(fresh, "resume-b", seed=99)  # another seed: everything comes from the checkpoint
    fresh.load("resume-b", "resume-a/weights/s2", with_optimizer=True)
    assert max_diff(weights_of(fresh, "resume-b"), weights_of(engine, "resume-a")) == 0.0
    assert fresh.host.get("resume-b").steps == 2

    (want,), _ = engine.run_cycle([ForwardBackwardItem("resume-a", nxt)], [OptimStepItem("resume-a", ADAM)])
    (got,), _ = fresh.run_cycle([ForwardBackwardItem("resume-b", nxt)], [OptimStepItem("resume-b", ADAM)])
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], abs=TOL)
    for a, b in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    assert max_diff(weights_of(fresh, "resume-b"), weights_of(engine, "resume-a")) <= TOL
    a, b = engine.host.get("resume-a"), fresh.host.get("resume-b")
    assert a.steps == b.steps == 3
    for name in a.params:  # Adam's moments went on alike
        sa, sb = a.optimizer.state[a.params[name]], b.optimizer.state[b.params[name]]
        assert float(sa["step"]) == float(sb["step"]) == 3.0
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], atol=TOL, rtol=0)
    engine.drop_adapter("resume-a")


# ---- 4. export (peft folder) and import ----------------------------------------------------------

def test_exported_adapter_imports_and_samples_like_the_original(fam, trained):
    engine, sampler = fam.engine, fam.sampler
    folder = engine.store.existing(trained["main"])
    config = imports.check_adapter_folder(folder, engine.lora)
    assert (config.rank, config.train_attn, config.train_mlp, config.train_unembed) == (4, True, True, True)
    assert config.expert_rank == (4 // TOP_K if fam.moe else 0)
    files = {name: (folder / name).read_bytes() for name in (imports.CONFIG_FILE, imports.WEIGHTS_FILE)}
    imported = "other-tenant/sampler_weights/imported"
    size, reported = engine.import_checkpoint(imported, files)
    assert size == sum(len(b) for b in files.values()) and reported == config
    sampler.load_adapter(imported, engine.store.existing(imported))
    try:
        for prompt in PROMPTS[:2]:
            want = sampler.sample(trained["main"], prompt, 2, SEEDED, True)
            got = sampler.sample(imported, prompt, 2, SEEDED, True)
            assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
            assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]
            np.testing.assert_array_equal(got.prompt_logprobs, want.prompt_logprobs)
    finally:
        sampler.drop_adapter(imported)
    # a run made with the config the import reports (as the servicer converts it) loads it exactly
    spec, _ = convert.adapter_from_pb(convert.imported_lora_to_pb(reported), 32.0, engine.lora)
    engine.create_adapter("import-run", spec, seed=0)
    engine.load("import-run", imported, with_optimizer=False)
    assert max_diff(weights_of(engine, "import-run"), weights_of(engine, "main")) == 0.0
    engine.drop_adapter("import-run")


def test_exported_adapter_loads_in_vanilla_peft(fam, trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fam.folder, dtype=torch.float32),
                                          str(fam.engine.store.existing(trained["main"])))
    ids = torch.tensor(PROMPTS[0][None].astype(np.int64))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with fam.engine.lora.route([("main", None)]):
            got = fam.engine.loaded.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


# ---- 5. co-batched == solo ------------------------------------------------------------------------

def test_two_tenants_co_batched_equal_each_alone(fam):
    engine = fam.engine
    tenants = {"x": dict(rank=4, seed=7), "y": dict(rank=8, attn=False, mlp=True, unembed=True, seed=8)}
    data = {"x": [sft_datum(t) for t in token_data(5, (9, 6))],
            "y": [sft_datum(t, np.random.default_rng(6).standard_normal(len(t) - 1)) for t in token_data(7, (11,))]}
    for mode in ("co", "solo"):
        for tenant, kwargs in tenants.items():
            create(engine, f"{mode}-{tenant}", **kwargs)
            perturb(engine, f"{mode}-{tenant}", seed=kwargs["seed"])  # B != 0: the adapters act from the start

    co, _ = engine.run_cycle([ForwardBackwardItem(f"co-{t}", data[t]) for t in tenants],
                             [OptimStepItem(f"co-{t}", ADAM) for t in tenants])
    solo = [engine.run_cycle([ForwardBackwardItem(f"solo-{t}", data[t])], [OptimStepItem(f"solo-{t}", ADAM)])[0][0]
            for t in tenants]
    for tenant, got, want in zip(tenants, co, solo):
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], abs=TOL), tenant
        for a, b in zip(got.logprobs, want.logprobs):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0, err_msg=tenant)
        assert max_diff(weights_of(engine, f"co-{tenant}"), weights_of(engine, f"solo-{tenant}")) <= TOL, tenant
    # after the step, forward passes of the two still agree (co-batched again vs alone)
    co, _ = engine.run_cycle([ForwardBackwardItem(f"co-{t}", data[t], forward_only=True) for t in tenants], [])
    for tenant, got in zip(tenants, co):
        (want,), _ = engine.run_cycle([ForwardBackwardItem(f"solo-{tenant}", data[tenant], forward_only=True)], [])
        for a, b in zip(got.logprobs, want.logprobs):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0, err_msg=tenant)
    for mode in ("co", "solo"):
        for tenant in tenants:
            engine.drop_adapter(f"{mode}-{tenant}")


# ---- 6. sampler == trainer ------------------------------------------------------------------------

def test_trainer_logprobs_equal_the_samplers_on_the_saved_adapter(fam, trained):
    for run_id in ("main", "other"):
        for prompt in PROMPTS:
            (result,), _ = fam.engine.run_cycle([ForwardBackwardItem(run_id, [sft_datum(prompt)], forward_only=True)], [])
            want = fam.sampler.compute_logprobs(trained[run_id], prompt)
            np.testing.assert_allclose(result.logprobs[0], want[1:], atol=TOL, rtol=0, err_msg=run_id)


def test_a_decode_batch_mixing_adapters_equals_each_request_alone(fam, trained):
    sampler = fam.sampler
    requests = [SampleRequest(trained["main"], PROMPTS[0], 1, GREEDY, prompt_logprobs=True),
                SampleRequest(trained["other"], PROMPTS[1], 2, GREEDY, prompt_logprobs=True),
                SampleRequest(None, PROMPTS[2], 1, GREEDY),
                SampleRequest(trained["other"], PROMPTS[0], 1, GREEDY),
                SampleRequest(trained["main"], PROMPTS[2], 1, GREEDY)]
    batched = sampler.sample_batch(requests)
    for request, got in zip(requests, batched):
        (want,) = sampler.sample_batch([request])
        for g, w in zip(got.sequences, want.sequences):
            assert g.tokens == w.tokens, request.checkpoint_key
            # other rows' left padding changes float32 reduction lengths: logprobs agree to rounding
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4, rtol=0)
        if request.prompt_logprobs:
            np.testing.assert_allclose(got.prompt_logprobs[1:], want.prompt_logprobs[1:], atol=1e-4, rtol=0)
    # the two adapters and the base model decode the same prompt differently
    same_prompt = sampler.sample_batch([SampleRequest(k, PROMPTS[0], 1, GREEDY) for k in (trained["main"], trained["other"], None)])
    logprobs = [np.array(r.sequences[0].logprobs) for r in same_prompt]
    assert not np.allclose(logprobs[0], logprobs[1]) and not np.allclose(logprobs[0], logprobs[2])


# ---- a model of no known family -------------------------------------------------------------------

def _unknown_config(kind):
    from transformers import GPT2Config, MixtralConfig

    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=128)
    # Llama-named projections and fused routed experts, but a family Temper does not train
    return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=128)


@pytest.fixture(scope="module")
def any_tiny_dir(family_dirs):
    return family_dirs["qwen3"]


def unknown_model(kind, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / kind
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_unknown_config(kind), dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_a_trainer_on_a_model_of_no_known_family_starts(kind, tmp_path, any_tiny_dir):
    """With default settings: the model still runs (LoraModel), adapters are refused by family name
    (below); starting must not fail on something else first (GPT-2 keeps its decoder blocks in .h)."""
    engine = TrainerEngine(quiet_load(unknown_model(kind, tmp_path, any_tiny_dir)),
                           TrainerSettings(checkpoint_dir=tmp_path / "ckpt", offload_dir=tmp_path / "off"))
    assert engine.lora.family is None and repr(kind) in engine.lora.family_error


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
def test_a_model_of_no_known_family_takes_no_adapter(kind, tmp_path, any_tiny_dir):
    from temper.services.trainer.servicer import TrainerServicer

    folder = unknown_model(kind, tmp_path, any_tiny_dir)
    # activation checkpointing off: GPT-2 has no decoder .layers (test_a_trainer_on_a_model_of_no_known_family_starts)
    engine = TrainerEngine(quiet_load(folder), TrainerSettings(checkpoint_dir=tmp_path / "ckpt", offload_dir=tmp_path / "off",
                                                               activation_checkpointing=False))

    # through the servicer, as a CreateAdapter RPC arrives
    servicer = TrainerServicer(engine)
    request = trainer_pb2.CreateAdapterRequest(training_run_id="run-u", lora_config=types_pb2.LoraConfig(
        rank=4, train_attn=True, train_mlp=True, train_unembed=True, seed=1))
    with pytest.raises(InvalidArgument) as refused:
        asyncio.run(servicer.CreateAdapter(request, None))
    assert refused.value.code.name == "INVALID_ARGUMENT" and repr(kind) in refused.value.message, refused.value.message
    # and straight to the engine with a spec made without the model (Llama-shaped names)
    for targets in [("lm_head",), ("q_proj", "v_proj")]:
        with pytest.raises(InvalidArgument, match=repr(kind)):
            engine.create_adapter("run-u", AdapterSpec(rank=4, alpha=32.0, targets=targets), seed=1)
    assert engine.host.adapters == {} and engine.lora.adapters == {}
    assert all(not layer.adapters for layer in engine.lora.layers.values())
    assert all(not experts.adapters for experts in engine.lora.experts.values())
    # nor does an adapter folder import into it, or load into a sampler on it
    source = TrainerEngine(quiet_load(any_tiny_dir), TrainerSettings(checkpoint_dir=tmp_path / "src", offload_dir=tmp_path / "o2"))
    create(source, "r", rank=4, attn=False, mlp=False, unembed=True)
    source.save("r", "r/sampler_weights/1", include_optimizer=False)
    exported = source.store.existing("r/sampler_weights/1")
    files = {name: (exported / name).read_bytes() for name in (imports.CONFIG_FILE, imports.WEIGHTS_FILE)}
    with pytest.raises(InvalidArgument, match=repr(kind)):
        engine.import_checkpoint("u/sampler_weights/1", files)
    assert not engine.store.exists("u/sampler_weights/1")
    sampler = TorchSamplerBackend(quiet_load(folder))
    with pytest.raises(InvalidArgument):
        sampler.load_adapter("k", exported)
    assert sampler.lora.adapters == {}
