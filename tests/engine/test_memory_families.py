"""The activation memory estimate (services/trainer/memory.py) for every model family Temper trains.

Structural: from each family's transformers config (the tiny models' configs, at a size where
activations dominate) the estimate grows as the layers it counts say: dense families keep the
Llama-style count; an MoE model adds its routed part over a dense one of the same size, scaling with
top_k; dense first layers, shared experts and MLA's latent attention are counted; MLA's and GPT-OSS's
attention probabilities where their kernels save them. Measured: on each family's tiny random model,
the bytes autograd saves inside the decoder layers of one engine pass against the estimate's count
(``benchmarks/memory_estimate.py --families`` checks the whole peak, in minutes).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from temper.common.validation import DecodedDatum
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.models.tiny import TINY_FAMILIES, build_tiny_model
from temper.services.trainer.engine import ForwardBackwardItem, TrainerEngine
from temper.services.trainer.memory import ActivationModel
from temper.services.trainer.settings import TrainerSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = tuple(TINY_FAMILIES)
MOE = ("qwen3_moe", "gpt_oss", "deepseek_v3")
IDS = dict(eos_token_id=0, bos_token_id=1, pad_token_id=2)
HIDDEN, LAYERS, VOCAB, WIDTH, CHUNK = 256, 4, 512, 256, 128
F32 = torch.float32


def config(family: str, hidden: int = HIDDEN, layers: int = LAYERS, **fields):
    cfg = TINY_FAMILIES[family](VOCAB, hidden, layers, IDS)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


def model(family: str, device=None, lora_rank: int = 64, **fields) -> ActivationModel:
    return ActivationModel.from_config(config(family, **fields), F32, lora_rank=lora_rank, device=device)


def test_every_family_is_covered():
    assert set(FAMILIES) == {"llama", "qwen3"} | set(MOE)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("eager", [False, True])
def test_dense_families_keep_the_llama_style_count(family, eager):
    cfg = config(family)
    cfg._attn_implementation = "eager" if eager else "sdpa"
    m = ActivationModel.from_config(cfg, F32)
    assert (m.experts, m.moe_layers, m.kv_lora_rank, m.attention_probabilities) == (0, 0, 0, False)
    h, i, q, r = m.hidden, m.intermediate, m.heads * m.head_dim, m.lora_rank
    layer = 3 * h + 3 * q + 2 * q + h + 4 * i + 7 * r + 2 + (2 * m.heads * WIDTH if eager else 0)
    assert m.layer_elements(WIDTH) == layer
    assert m.decoder_elements(WIDTH) == m.layers * layer
    tokens = 8 * WIDTH
    head = 3.0 * CHUNK * m.vocab * 4
    stored = 1.15 * (tokens * (m.layers * layer + 4 * h + 3 * i + 2 * h) * 4 + head)
    checkpointed = 1.15 * (tokens * (m.layers * h + layer + 4 * h + 3 * i + 2 * h) * 4 + head)
    assert m.pass_bytes(tokens, WIDTH, False, CHUNK) == pytest.approx(stored, rel=1e-12)
    assert m.pass_bytes(tokens, WIDTH, True, CHUNK) == pytest.approx(checkpointed, rel=1e-12)


def test_moe_adds_its_routed_part_over_a_dense_model_of_the_same_size():
    dense, moe = model("qwen3"), model("qwen3_moe")
    assert (moe.experts, moe.top_k, moe.moe_layers, moe.dense_layers) == (8, 2, LAYERS, 0)
    assert (moe.hidden, moe.heads, moe.head_dim) == (dense.hidden, dense.heads, dense.head_dim)
    assert moe.attention_elements(WIDTH) == dense.attention_elements(WIDTH)
    extra = moe.decoder_elements(WIDTH) - dense.decoder_elements(WIDTH)
    assert extra == pytest.approx(LAYERS * (moe.routed_elements() - dense.dense_mlp_elements(dense.intermediate)))
    # top_k copies of every token cost more than top_k dense MLPs of the expert width (inputs, deltas,
    # scatter, indices), and the expert LoRA's inputs at least the routed rows'
    per_expert = moe.dense_mlp_elements(moe.expert_intermediate) - 3 * moe.lora_rank
    assert moe.routed_elements() > moe.top_k * (per_expert + moe.hidden + moe.expert_intermediate)
    assert moe.expert_padding >= 1.0
    # the (adapter, expert) LoRA factors: per pass, bounded by experts per row and by routed rows
    assert moe.expert_factor_elements(4, 1024) == 4 * 8 * moe.expert_rank * (2 * HIDDEN + 3 * moe.expert_intermediate)
    assert moe.expert_factor_elements(4, 8) == 8 * 2 * moe.expert_rank * (2 * HIDDEN + 3 * moe.expert_intermediate)
    assert dense.expert_factor_elements(4, 1024) == 0
    for checkpointed in (False, True):
        assert moe.pass_bytes(2048, WIDTH, checkpointed, CHUNK) > dense.pass_bytes(2048, WIDTH, checkpointed, CHUNK)


def test_the_routed_part_scales_with_top_k_not_with_the_experts():
    # the same expert rank (lora_rank / top_k) at top_k 2 and 4: every row costs the same, twice the rows
    k2 = model("qwen3_moe", lora_rank=64)
    k4 = model("qwen3_moe", lora_rank=128, num_experts_per_tok=4)
    assert (k2.top_k, k4.top_k, k2.expert_rank, k4.expert_rank) == (2, 4, 32, 32)
    assert 1.95 < k4.routed_elements() / k2.routed_elements() <= 2.0
    # more experts: only the router's per-token scores grow (and the per-pass factors)
    many = model("qwen3_moe", num_experts=64)
    assert many.experts == 64
    assert 0 < many.routed_elements() - k2.routed_elements() <= 5 * 64
    assert many.expert_factor_elements(4, 4096) == 8 * k2.expert_factor_elements(4, 4096)
    # a wider expert: the routed rows' intermediate tensors grow top_k-fold
    wide = model("qwen3_moe", moe_intermediate_size=HIDDEN)
    grown = (wide.routed_elements() - k2.routed_elements()) / (HIDDEN - HIDDEN // 2)
    assert k2.top_k * (2 + k2.expert_glu) < grown < k2.top_k * (2 + k2.expert_glu + 2 * k2.expert_padding)


def test_dense_first_layers_and_shared_experts_are_counted():
    ds = model("deepseek_v3")
    assert (ds.dense_layers, ds.moe_layers, ds.shared_intermediate) == (1, LAYERS - 1, HIDDEN // 2)
    common = 4 * ds.hidden + 2 + ds.attention_elements(WIDTH)
    dense_layer = common + ds.dense_mlp_elements(ds.intermediate)
    moe_layer = common + ds.routed_elements() + ds.dense_mlp_elements(ds.shared_intermediate)
    assert ds.decoder_elements(WIDTH) == pytest.approx(dense_layer + (LAYERS - 1) * moe_layer)
    assert ds.layer_elements(WIDTH) == pytest.approx(max(dense_layer, moe_layer))
    no_shared = model("deepseek_v3", n_shared_experts=0)
    assert no_shared.shared_intermediate == 0
    assert ds.decoder_elements(WIDTH) - no_shared.decoder_elements(WIDTH) == pytest.approx(
        (LAYERS - 1) * ds.dense_mlp_elements(HIDDEN // 2))
    all_dense = model("deepseek_v3", first_k_dense_replace=LAYERS)
    assert all_dense.moe_layers == 0 and all_dense.expert_factor_elements(4, 1024) == 0
    # Qwen3-MoE's mlp_only_layers are dense MLPs intermediate_size wide
    qwen = model("qwen3_moe", mlp_only_layers=[0])
    assert (qwen.dense_layers, qwen.moe_layers) == (1, LAYERS - 1)
    assert qwen.decoder_elements(WIDTH) != model("qwen3_moe").decoder_elements(WIDTH)


def test_mla_counts_its_latent_attention_and_where_sdpa_saves_probabilities():
    cpu, cuda = model("deepseek_v3", device="cpu"), model("deepseek_v3", device=torch.device("cuda"))
    assert (cpu.q_lora_rank, cpu.kv_lora_rank, cpu.qk_nope_head_dim, cpu.qk_rope_head_dim, cpu.v_head_dim) == (
        HIDDEN // 2, HIDDEN // 2, 16, 8, 16)
    # v narrower than q/k: the CPU's fused sdpa refuses it and the math kernel saves heads x width
    assert cpu.attention_probabilities and not cuda.attention_probabilities and not cpu.eager_attention
    assert model("deepseek_v3").attention_probabilities  # device unknown: counted as off CUDA
    assert cpu.attention_elements(WIDTH) - cuda.attention_elements(WIDTH) == cpu.heads * WIDTH
    assert cpu.attention_elements(2 * WIDTH) - cpu.attention_elements(WIDTH) == cpu.heads * WIDTH
    assert cuda.attention_elements(2 * WIDTH) == cuda.attention_elements(WIDTH)
    gap = [cpu.pass_bytes(t, t, False, CHUNK) - cuda.pass_bytes(t, t, False, CHUNK) for t in (256, 1024)]
    assert gap[1] > 12 * gap[0]  # 4x the tokens of 4x the width: quadratic in the row length
    # every latent width counts: q_a and its norm, the compressed kv and its norm
    wider_kv = model("deepseek_v3", device="cuda", kv_lora_rank=HIDDEN)
    wider_q = model("deepseek_v3", device="cuda", q_lora_rank=HIDDEN)
    assert wider_kv.attention_elements(WIDTH) - cuda.attention_elements(WIDTH) == 2 * (HIDDEN - HIDDEN // 2)
    assert wider_q.attention_elements(WIDTH) - cuda.attention_elements(WIDTH) == 2 * (HIDDEN - HIDDEN // 2)
    # heads x (qk_nope + qk_rope) for q and k, heads x v for v and the output
    more_heads = model("deepseek_v3", device="cuda", num_attention_heads=8, num_key_value_heads=8)
    per_head = 2 * (16 + 8) + (16 + 16) + 2 * 16
    assert more_heads.attention_elements(WIDTH) - cuda.attention_elements(WIDTH) == 4 * per_head
    plain_q = model("deepseek_v3", device="cuda", q_lora_rank=None)  # q_proj: no q_a/q_b, one LoRA fewer
    assert cuda.attention_elements(WIDTH) - plain_q.attention_elements(WIDTH) == 2 * (HIDDEN // 2) + cuda.lora_rank
    # a v head as wide as q/k: sdpa's fused kernel on CPU too
    assert not model("deepseek_v3", device="cpu", v_head_dim=24).attention_probabilities


def test_gpt_oss_is_counted_eager_with_its_wider_glu():
    cfg = config("gpt_oss")
    for attention in (None, "sdpa", "eager"):  # transformers has no sdpa for it: eager unless flash/flex
        cfg._attn_implementation = attention
        m = ActivationModel.from_config(cfg, F32)
        assert m.attention_probabilities and not m.eager_attention
    cfg._attn_implementation = "flex_attention"
    assert not ActivationModel.from_config(cfg, F32).attention_probabilities
    gpt, qwen = model("gpt_oss"), model("qwen3_moe")
    assert (gpt.expert_glu, qwen.expert_glu, gpt.expert_intermediate, qwen.expert_intermediate) == (6, 3, 128, 128)
    assert gpt.routed_elements() - qwen.routed_elements() == pytest.approx(gpt.top_k * 3 * 128)
    # probabilities once per layer saved, the backward's two gradients of them once
    assert gpt.attention_elements(2 * WIDTH) - gpt.attention_elements(WIDTH) == gpt.heads * WIDTH
    assert gpt.backward_elements(8 * WIDTH) == 4 * HIDDEN + 2 * gpt.heads * 8 * WIDTH


@pytest.mark.parametrize("family", FAMILIES)
def test_passes_grow_with_tokens_and_checkpointing_saves(family):
    m = model(family)
    for width in (64, 256, 1024):
        stored = [m.pass_bytes(n * width, width, False, CHUNK) for n in (1, 2, 8)]
        checkpointed = [m.pass_bytes(n * width, width, True, CHUNK) for n in (1, 2, 8)]
        assert stored == sorted(stored) and checkpointed == sorted(checkpointed)
        assert all(c < s for c, s in zip(checkpointed, stored))
        assert width - 1 <= m.stored_tokens(m.pass_bytes(width, width, False, CHUNK), width, CHUNK) <= width
    assert m.stored_tokens(0, 256, CHUNK) == 0


def test_a_config_of_no_known_family_is_counted_as_a_dense_model():
    from transformers import MixtralConfig

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    m = ActivationModel.from_config(cfg, torch.bfloat16)
    assert (m.experts, m.kv_lora_rank, m.dtype_bytes) == (0, 0, 2)
    broken = config("qwen3_moe", num_experts_per_tok=16)  # check_config refuses top_k > experts
    assert ActivationModel.from_config(broken, F32).experts == 0


def test_the_model_is_a_plain_frozen_record():
    m = model("deepseek_v3")
    assert dataclasses.replace(m) == m and hash(m) == hash(dataclasses.replace(m))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.layers = 1


# ---- measured: what autograd saves in one engine pass --------------------------------------------

ROWS, TENANTS, TOKENS, RANK = 4, 2, 64, 16




def saved_bytes(model, modules, run) -> int:
    """Bytes of the tensors autograd saves inside ``modules`` (parameters of ``model`` excluded, each
    storage once) during ``run()``, one cycle whose results hold no exception."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    depth, saved = [0], {}

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    def pack(tensor):
        if depth[0]:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    handles = []
    for module in modules:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            results = run()
    finally:
        for handle in handles:
            handle.remove()
    assert not any(isinstance(r, Exception) for r in results), results
    return sum(saved.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_activations_match_the_estimate(family, tmp_path):
    """One stored pass of 4 rows x 64 tokens (2 tenants, rank 16, every group a run trains): what the
    decoder layers save is the estimate's count within its slack (measured 0.86-1.05)."""
    folder = build_tiny_model(tmp_path / "model", hidden_size=128, layers=2, family=family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(str(folder))
    settings = TrainerSettings(checkpoint_dir=tmp_path / "ckpt", offload_dir=tmp_path / "offload",
                               activation_checkpointing=False)
    engine = TrainerEngine(loaded, settings)
    assert (engine.activations.moe_layers > 0) == (family in MOE)
    spec = AdapterSpec(rank=RANK, alpha=32.0, targets=engine.lora.group_targets(attn=True, mlp=True))
    for t in range(TENANTS):
        engine.create_adapter(f"tenant-{t}", spec, seed=t)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, VOCAB, TOKENS + 1) for _ in range(ROWS)]

    def datum(tokens):
        return DecodedDatum(tokens=np.asarray(tokens[:-1], np.int32),
                            inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(TOKENS, np.float32)})

    items = [ForwardBackwardItem(f"tenant-{t}", [datum(r) for r in rows[t::TENANTS]], "cross_entropy", {}, False)
             for t in range(TENANTS)]
    # what the decoder layers save during one forward_backward cycle
    measured = saved_bytes(loaded.model, loaded.model.model.layers, lambda: engine.run_cycle(items, [])[0])
    m = ActivationModel.from_config(loaded.model.config, F32, lora_rank=RANK, device="cpu")
    tokens = ROWS * TOKENS
    estimate = (m.decoder_elements(TOKENS) * tokens + m.moe_layers * m.expert_factor_elements(ROWS, tokens)) * 4
    assert 0.75 < measured / estimate < 1.25, (family, measured, estimate)
