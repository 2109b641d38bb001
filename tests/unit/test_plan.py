"""The model layout catalogue (services/models/catalogue.py) and ``python -m temper.plan`` (temper/plan.py):
device specs, catalogue validation, the layouts' per-rank memory, and a Qwen3-235B-A22B-shaped config
that needs more than one 141 GiB device but fits eight. Configs only: models are built on the meta device."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen3Config, Qwen3MoeConfig

from temper.plan import (ADAPTER_BYTES_PER_PARAM, GIB, Devices, count_parameters, main, parse_devices, plan_layouts,
                         rank_counts)
from temper.services.models.catalogue import DEFAULT_LAYOUT, Catalogue, ModelLayout, check_divides


def qwen3_235b() -> Qwen3MoeConfig:
    """Qwen3-235B-A22B's published shape."""
    return Qwen3MoeConfig(hidden_size=4096, num_hidden_layers=94, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=1536, intermediate_size=12288, num_attention_heads=64,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          max_position_embeddings=40960)


def qwen3_8b() -> Qwen3Config:
    return Qwen3Config(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe_counts():
    return count_parameters(qwen3_235b(), 32)


# ---- device specs --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("8x141GiB", Devices(8, 141 * GIB, "cuda")),
    ("2x80GB", Devices(2, 80 * 10**9, "cuda")),
    ("cpu:2x24GiB", Devices(2, 24 * GIB, "cpu")),
    ("gpu:4X40gib", Devices(4, 40 * GIB, "cuda")),
    ("cuda:1x0.5TiB", Devices(1, 512 * GIB, "cuda")),
    ("141GiB", Devices(1, 141 * GIB, "cuda")),
])
def test_device_specs(spec, expected):
    assert parse_devices(spec) == expected


@pytest.mark.parametrize("spec, says", [
    ("8x141", "expected [kind:]COUNTxSIZEUNIT"),
    ("eightx141GiB", "expected [kind:]COUNTxSIZEUNIT"),
    ("8x141GiB/s", "expected"),
    ("tpu:8x141GiB", "kind 'tpu'"),
    ("8x141GiBs", "unit 'gibs'"),
    ("0x80GB", "device count 0"),
    ("2x0GB", "must be above 0"),
])
def test_bad_device_specs_say_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match="device spec") as error:
        parse_devices(spec)
    assert says in str(error.value)


def test_rank_counts_double_up_to_the_devices():
    assert rank_counts(1) == [1]
    assert rank_counts(8) == [1, 2, 4, 8]
    assert rank_counts(6) == [1, 2, 4, 6]


# ---- the catalogue -------------------------------------------------------------------------------


def test_catalogue_parses_and_defaults():
    catalogue = Catalogue.from_json('{"Qwen/Qwen3-235B-A22B": {"ranks_per_trainer": 8, "sampler_tp_size": 4}}')
    layout = catalogue.layout("Qwen/Qwen3-235B-A22B")
    assert (layout.ranks_per_trainer, layout.devices_per_rank, layout.sampler_tp_size, layout.sampler_dp_size) == (8, 1, 4, 1)
    assert (layout.trainer_devices, layout.sampler_devices) == (8, 4)
    assert catalogue.layout("HuggingFaceTB/SmolLM2-135M-Instruct") == DEFAULT_LAYOUT == ModelLayout(
        ranks_per_trainer=1, devices_per_rank=1, sampler_tp_size=1, sampler_dp_size=1)
    assert "Qwen/Qwen3-235B-A22B" in catalogue and "other" not in catalogue
    assert Catalogue.from_json("").root == {} and Catalogue.from_json(None).root == {}
    assert Catalogue.from_env({"TEMPER_MODEL_CATALOGUE": '{"m": {"devices_per_rank": 2}}'}).layout("m").devices_per_rank == 2


@pytest.mark.parametrize("text, says", [
    ('{"m": {"ranks_per_trainer": 0}}', ["m.ranks_per_trainer=0", "greater than or equal to 1"]),
    ('{"m": {"sampler_tp_size": -2}}', ["m.sampler_tp_size=-2"]),
    ('{"m": {"devices_per_rank": "two"}}', ["m.devices_per_rank='two'"]),
    ('{"m": {"ranks": 8}}', ["m.ranks=8", "Extra inputs"]),
    ('{"m": 8}', ["m=8"]),
    ('["m"]', ["JSON object"]),
    ('{"m": {', ["not JSON"]),
])
def test_catalogue_errors_name_the_model_field_and_value(text, says):
    with pytest.raises(ValueError, match="TEMPER_MODEL_CATALOGUE") as error:
        Catalogue.from_json(text)
    for part in says:
        assert part in str(error.value)


def test_divides_accepts_any_fsdp2_rank_count_and_valid_tensor_parallel_sizes():
    config = qwen3_235b()
    for ranks in (1, 3, 5, 8):          # FSDP2 pads the last shard: nothing must divide
        check_divides(config, ModelLayout(ranks_per_trainer=ranks))
    for tp in (1, 2, 4, 8, 16):         # 64 heads split; 4 kv heads split (2, 4) or replicate (8, 16)
        check_divides(config, ModelLayout(sampler_tp_size=tp, sampler_dp_size=2))
    check_divides(config, ModelLayout(ranks_per_trainer=8, experts_per_rank=True))


@pytest.mark.parametrize("layout, says", [
    (ModelLayout(sampler_tp_size=3), "64 attention heads do not split over sampler_tp_size=3 (64 % 3 = 1)"),
    (ModelLayout(ranks_per_trainer=3, experts_per_rank=True),
     "128 routed experts do not divide over ranks_per_trainer=3 (experts placed per rank: 128 % 3 = 2)"),
])
def test_divides_refuses_with_the_numbers(layout, says):
    with pytest.raises(ValueError) as error:
        check_divides(qwen3_235b(), layout, "Qwen/Qwen3-235B-A22B")
    assert str(error.value) == f"Qwen/Qwen3-235B-A22B: {says}"


def test_divides_refuses_kv_heads_neither_split_nor_replicated():
    config = Qwen3Config(hidden_size=768, num_attention_heads=48, num_key_value_heads=4, intermediate_size=2304,
                         num_hidden_layers=2, vocab_size=512)
    check_divides(config, ModelLayout(sampler_tp_size=8))   # 4 kv heads replicate to 8
    with pytest.raises(ValueError, match=r"4 key/value heads .* sampler_tp_size=6 \(4 % 6 = 4, 6 % 4 = 2\)"):
        check_divides(config, ModelLayout(sampler_tp_size=6))
    config.intermediate_size = 2300
    with pytest.raises(ValueError, match=r"intermediate_size=2300 does not split over sampler_tp_size=8 \(2300 % 8 = 4\)"):
        check_divides(config, ModelLayout(sampler_tp_size=8))
    with pytest.raises(ValueError, match="experts_per_rank is for mixture-of-experts models"):
        check_divides(config, ModelLayout(experts_per_rank=True))


def test_divides_refuses_an_expert_width_tp_does_not_split():
    config = qwen3_235b()
    config.moe_intermediate_size = 1540
    with pytest.raises(ValueError, match=r"moe_intermediate_size=1540 .* sampler_tp_size=8 \(1540 % 8 = 4\)"):
        check_divides(config, ModelLayout(sampler_tp_size=8))


# ---- parameter counts and layouts ---------------------------------------------------------------


def test_counts_from_the_config_alone(moe_counts):
    c = moe_counts
    assert c.family == "qwen3_moe" and c.layers == 94 and (c.rank, c.expert_rank) == (32, 4)
    assert 235.0e9 < c.params < 235.2e9                      # Qwen3-235B-A22B: 235B parameters
    h, q, kv, e, i = 4096, 64 * 128, 4 * 128, 128, 1536
    assert c.root_params == 2 * 151936 * h + h               # embeddings, unembedding, final norm
    assert c.lora_linear_params == 94 * 32 * ((h + q) + 2 * (h + kv) + (q + h))
    assert c.lora_expert_params == 94 * e * 4 * ((h + 2 * i) + (i + h))
    assert c.lora_params == c.lora_linear_params + c.lora_expert_params


def test_235b_moe_does_not_fit_one_141gib_device_but_fits_eight(moe_counts):
    config = qwen3_235b()
    one = plan_layouts(config, parse_devices("1x141GiB"), counts=moe_counts)
    assert [p.fits for p in one.layouts] == [False]
    assert one.layouts[0].base_bytes == moe_counts.params * 2 > 141 * GIB
    eight = plan_layouts(config, parse_devices("8x141GiB"), counts=moe_counts)
    assert [p.ranks for p in eight.layouts] == [1, 2, 4, 8]
    assert [p.fits for p in eight.layouts] == [False, False, True, True]
    assert eight.to_json()["fitting_ranks"] == [4, 8]
    last = eight.layouts[-1]
    assert last.headroom_bytes > 40 * GIB and last.activations == "stored"
    assert last.adapter_bytes == moe_counts.lora_params * ADAPTER_BYTES_PER_PARAM


@pytest.mark.parametrize("which", ["moe", "dense"])
def test_per_rank_memory_falls_with_the_ranks(which, moe_counts):
    config, counts = (qwen3_235b(), moe_counts) if which == "moe" else (qwen3_8b(), None)
    plan = plan_layouts(config, parse_devices("8x141GiB"), tokens=16384, adapters=4, counts=counts)
    layouts = plan.layouts
    for fewer, more in zip(layouts, layouts[1:]):
        assert more.base_bytes < fewer.base_bytes
        assert more.tokens_per_rank < fewer.tokens_per_rank
        assert more.stored_bytes < fewer.stored_bytes and more.checkpointed_bytes < fewer.checkpointed_bytes
        assert more.total_bytes < fewer.total_bytes
        assert more.adapter_bytes == fewer.adapter_bytes > 0        # replicated on every rank
        assert more.max_adapters >= fewer.max_adapters
    assert layouts[0].gathered_bytes == 0 and len({p.gathered_bytes for p in layouts[1:]}) == 1


def test_adapters_scale_the_replicated_state(moe_counts):
    one = plan_layouts(qwen3_235b(), parse_devices("8x141GiB"), adapters=1, counts=moe_counts).layouts[-1]
    many = plan_layouts(qwen3_235b(), parse_devices("8x141GiB"), adapters=16, counts=moe_counts).layouts[-1]
    assert many.adapter_bytes == 16 * one.adapter_bytes
    assert not many.fits and 0 < one.max_adapters < 16


def test_cli_prints_json_and_a_table(tmp_path, capsys):
    qwen3_8b().save_pretrained(tmp_path / "model")
    assert main(["--model", str(tmp_path / "model" / "config.json"), "--devices", "2x80GB", "--json", "--name", "m",
                 "--catalogue", '{"m": {"ranks_per_trainer": 2, "sampler_tp_size": 8}}']) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["ranks"] for p in out["layouts"]] == [1, 2] and out["family"] == "qwen3"
    assert out["catalogue_layout"]["ranks_per_trainer"] == 2 and out["fitting_ranks"] == [1, 2]
    assert main(["--model", str(tmp_path / "model"), "--devices", "cpu:2x24GiB", "--tokens", "4096"]) == 0
    table = capsys.readouterr().out
    assert "base/N" in table and "headroom" in table and "Fits with" in table


@pytest.mark.parametrize("argv, says", [
    (["--devices", "8x"], "device spec '8x'"),
    (["--devices", "8x141GiB", "--dtype", "int3"], "dtype 'int3'"),
    (["--devices", "8x141GiB", "--catalogue", '{"m": {"sampler_tp_size": 3}}'], "m: 32 attention heads"),
])
def test_cli_refuses_with_a_clear_error(tmp_path, capsys, argv, says):
    qwen3_8b().save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--name", "m", *argv]) == 2
    assert says in capsys.readouterr().err


def test_cli_refuses_a_folder_without_a_config(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--devices", "8x141GiB"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "missing.json"), "--devices", "8x141GiB"]) == 2
    assert "no such model folder or config file" in capsys.readouterr().err
