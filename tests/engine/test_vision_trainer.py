"""The trainer with images (issue 30), on the tiny Qwen3-VL and Qwen3-VL-MoE models, against a direct
torch computation: the transformers model's own forward with the processor's pixel_values,
image_grid_thw and mm_token_type_ids, log_softmax, gather. Items go through ``convert`` as the
servicer decodes them (the model's VisionProcessor flattens each image into its tokens)."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import torch

from temper.common.codec import encode_array, encode_tokens
from temper.common.errors import FailedPrecondition, InvalidArgument
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.trainer import convert
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, types_pb2

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ("qwen3_vl", "qwen3_vl_moe")


def noise_png(seed: int, size=(64, 64)) -> bytes:
    """A random-noise image (a solid one would make every image look alike to the tower)."""
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def text(tokens) -> types_pb2.ModelInputChunk:
    return types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens)))


def image(data: bytes, expected: int | None = None) -> types_pb2.ModelInputChunk:
    chunk = types_pb2.ImageChunk(data=data, format="png")
    if expected is not None:
        chunk.expected_tokens = expected
    return types_pb2.ModelInputChunk(image=chunk)


def datum(vision, pieces, seed: int, length: int) -> types_pb2.Datum:
    """``pieces``: token lists and image bytes in order (each image between vision start and end tokens);
    ``length``: the flattened length (the targets' and weights' length)."""
    chunks = []
    for piece in pieces:
        if isinstance(piece, bytes):
            chunks += [text([vision.tokens.start]), image(piece), text([vision.tokens.end])]
        else:
            chunks.append(text(piece))
    rng = np.random.default_rng(seed)
    return types_pb2.Datum(model_input=types_pb2.ModelInput(chunks=chunks), loss_fn_inputs={
        "target_tokens": encode_array(rng.integers(0, 400, length), "int64"),
        "weights": encode_array(rng.standard_normal(length).astype(np.float32), "float32")})


def item(run_id, data, forward_only=False) -> trainer_pb2.ForwardBackwardItem:
    return trainer_pb2.ForwardBackwardItem(training_run_id=run_id, data=data, loss_fn="cross_entropy",
                                           forward_only=forward_only)


def run_wire(engine, items):
    """A cycle as the servicer runs it: decoded with the model's vision processor, then the engine."""
    loaded = engine.loaded
    request = trainer_pb2.CycleRequest(forward_backward=items)
    decoded, steps = convert.cycle_from_pb(request, loaded.vocab_size, loaded.max_context_length, loaded.vision,
                                           engine.image_limits, loaded.name)
    return engine.run_cycle(decoded, steps)[0]


def make_engine(folder, tmp_path, **settings) -> TrainerEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(folder)
    return TrainerEngine(loaded, TrainerSettings(checkpoint_dir=tmp_path / "ckpt", offload_dir=tmp_path / "offload",
                                                 **settings))


def add_adapter(engine, run_id: str, vision: bool, seed: int):
    """An adapter of attention + MLP (+ the tower's linears) with every factor random (B too: a fresh
    adapter's zero B would hide a missing LoRA)."""
    spec = AdapterSpec(rank=4, alpha=8.0, targets=engine.lora.group_targets(attn=True, mlp=True, vision=vision))
    adapter = engine.create_adapter(run_id, spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter.params.values():
            param.normal_(0.0, 0.05, generator=generator)
    return adapter


def grads(engine, run_id) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in engine.host.get(run_id).params.items() if p.grad is not None}


def own_logprobs(model, vision, d, masked=True) -> torch.Tensor:
    """log p(target) of one decoded datum from a transformers model's own forward (pixel_values through
    its processor, its own multimodal positions), unpadded: with an all-ones attention mask where
    ``masked``, else with neither mask nor cache (the Qwen3.5 tests)."""
    ids = torch.tensor(d.tokens, dtype=torch.long)[None]
    kwargs = dict(vision.pixels(list(d.images)), mm_token_type_ids=(ids == vision.tokens.image).int()) if d.images else {}
    kwargs.update({"attention_mask": torch.ones_like(ids)} if masked else {"use_cache": False})
    logits = model(input_ids=ids, **kwargs).logits[0].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(d.inputs["target_tokens"])[:, None])[:, 0]


def direct(engine, run_id, decoded, with_grad=True, masked=True):
    """Per datum, log p(target) from the transformers model's own forward (``own_logprobs``), one datum
    at a time; the gradients of the weighted sum."""
    model, vision = engine.loaded.model, engine.loaded.vision
    for p in engine.host.get(run_id).params.values():
        p.grad = None
    out = []
    for d in decoded:
        model.model.rope_deltas = None
        with torch.set_grad_enabled(with_grad), engine.lora.route([(run_id, None)]):
            lp = own_logprobs(model, vision, d, masked)
        if with_grad:
            (-(lp * torch.tensor(d.inputs["weights"])).sum()).backward()
        out.append(lp.detach().numpy())
    return out, grads(engine, run_id) if with_grad else {}


def decode(engine, data):
    loaded = engine.loaded
    return convert.forward_backward_from_pb(item("x", data), loaded.vocab_size, None, loaded.vision).data


def sample_data(vision, seed=0):
    """Two rows with images (one with three, one of them shared with the first row) and one text-only row."""
    a, b, c = noise_png(seed + 1), noise_png(seed + 2, (96, 64)), noise_png(seed + 3)
    return [datum(vision, [[1, 2, 3], a, [4, 5]], seed, 3 + 6 + 2),
            datum(vision, [[7], c, [8, 9], b, [10], a], seed + 1, 1 + 6 + 2 + 8 + 1 + 6),
            datum(vision, [[11, 12, 13, 14, 15, 16]], seed + 2, 6)]


def assert_grads_close(got, want):
    assert got.keys() == want.keys() and got
    for name in want:  # float32 sums in another order: within 1e-4 of each tensor's own scale
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6 + 1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}")


def check_forward_backward_matches_own_forward(folder, tmp_path, train_vision, masked=True) -> dict[str, torch.Tensor]:
    """forward_backward with images against ``direct``: logprobs and every LoRA gradient (the tower's
    trained only when the run asks for it); the gradients, for the caller's own checks."""
    engine = make_engine(folder, tmp_path)
    add_adapter(engine, "run-a", train_vision, seed=3)
    data = sample_data(engine.loaded.vision)
    (result,) = run_wire(engine, [item("run-a", data)])
    got = grads(engine, "run-a")
    want_lp, want_grads = direct(engine, "run-a", decode(engine, data), masked=masked)
    for lp, want in zip(result.logprobs, want_lp):
        np.testing.assert_allclose(lp, want, atol=1e-5, rtol=0)
    assert_grads_close(got, want_grads)
    tower = [name for name in got if ".visual." in name]
    assert bool(tower) == train_vision  # the tower's LoRA is trained only when the run asks for it
    if train_vision:
        assert all(got[name].abs().sum() > 0 for name in tower)
    return got


def check_three_adapters_equal_each_run_alone(folder, tmp_path):
    """Adapters with and without the tower trained, image rows and text rows, one shared cycle (split
    into micro-batches, checkpointed): each run's logprobs and gradients equal that run alone."""
    engines = {name: make_engine(folder, tmp_path / name, max_tokens_per_microbatch=48,
                                 activation_checkpointing_min_tokens=0) for name in ("shared", "alone")}
    runs = {"run-v": True, "run-t": False, "run-u": False}
    for engine in engines.values():
        for n, (run_id, vision) in enumerate(runs.items()):
            add_adapter(engine, run_id, vision, seed=10 + n)
    vision = engines["shared"].loaded.vision
    data = {run_id: sample_data(vision, seed=n)[n % 2:] for n, run_id in enumerate(runs)}
    shared = run_wire(engines["shared"], [item(run_id, data[run_id], forward_only=run_id == "run-u") for run_id in runs])
    for k, run_id in enumerate(runs):
        (alone,) = run_wire(engines["alone"], [item(run_id, data[run_id], forward_only=run_id == "run-u")])
        for got, want in zip(shared[k].logprobs, alone.logprobs):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        if run_id != "run-u":
            assert_grads_close(grads(engines["shared"], run_id), grads(engines["alone"], run_id))


def check_peft_export_matches_on_images(folder, tmp_path, train_vision, masked=True):
    """The saved adapter (adapter_config.json + safetensors) on the vanilla transformers model through
    peft: the trainer's logprobs on image rows within 1e-5 (fp32). Returns the engine, the peft model,
    the export folder and its adapter_config.json."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    engine = make_engine(folder, tmp_path)
    add_adapter(engine, "run-a", train_vision, seed=4)
    data = sample_data(engine.loaded.vision)
    (result,) = run_wire(engine, [item("run-a", data, forward_only=True)])
    engine.save("run-a", "tenant/run-a/export", include_optimizer=False)
    export = engine.store.existing("tenant/run-a/export")
    config = json.loads((export / "adapter_config.json").read_text())
    assert ("qkv" in config["target_modules"]) == train_vision
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, str(export)).eval()
    for d, got in zip(decode(engine, data), result.logprobs):
        with torch.no_grad():
            want = own_logprobs(peft_model, engine.loaded.vision, d, masked).numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    return engine, peft_model, export, config


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train_vision", [False, True])
def test_forward_backward_with_images_matches_the_model_s_own_forward(vl_model_dirs, tmp_path, family, train_vision):
    check_forward_backward_matches_own_forward(vl_model_dirs[family], tmp_path, train_vision)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_and_text_rows_of_three_adapters_share_passes_and_equal_each_run_alone(vl_model_dirs, tmp_path, family):
    check_three_adapters_equal_each_run_alone(vl_model_dirs[family], tmp_path)


def count_tower_images(engine) -> list[int]:
    """Images per vision-tower call (a forward hook on the tower)."""
    calls = []
    engine.loaded.model.model.visual.register_forward_hook(lambda _m, args, kwargs, _out: calls.append(len(kwargs["grid_thw"])),
                                                           with_kwargs=True)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_each_image_goes_through_the_base_tower_once_per_cycle(vl_model_dirs, tmp_path, family):
    """Two adapters (no tower LoRA), the same image in four rows over several micro-batches: encoded
    once in the cycle; a second cycle encodes it again (the cache lives for one cycle)."""
    engine = make_engine(vl_model_dirs[family], tmp_path, max_tokens_per_microbatch=16)
    for n, run_id in enumerate(("run-a", "run-b")):
        add_adapter(engine, run_id, False, seed=n)
    vision = engine.loaded.vision
    shared, other = noise_png(7), noise_png(8)
    rows = [datum(vision, [[1], shared, [2]], n, 1 + 6 + 1) for n in range(2)]
    calls = count_tower_images(engine)
    results = run_wire(engine, [item("run-a", rows), item("run-b", rows + [datum(vision, [other, [3]], 5, 7)])])
    assert not any(isinstance(r, Exception) for r in results)
    assert sum(calls) == 2 and len(calls) <= 2  # two distinct images, each once
    again = run_wire(engine, [item("run-b", rows[:1])])[0].logprobs[0]
    np.testing.assert_allclose(results[1].logprobs[0], again, atol=1e-5, rtol=0)
    assert sum(calls) == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_no_position_state_leaks_between_rows_or_calls(vl_model_dirs, tmp_path, family):
    """A text row after an image row, and after the model's own cached rope_deltas were set (as a
    generate call would): the same numbers as on a fresh engine."""
    engines = [make_engine(vl_model_dirs[family], tmp_path / str(n)) for n in range(2)]
    for engine in engines:
        add_adapter(engine, "run-a", True, seed=1)
    vision = engines[0].loaded.vision
    image_row, text_row = sample_data(vision)[1], sample_data(vision)[2]
    run_wire(engines[0], [item("run-a", [image_row], forward_only=True)])
    engines[0].loaded.model.model.rope_deltas = torch.tensor([[1000]])
    after = run_wire(engines[0], [item("run-a", [text_row], forward_only=True)])[0].logprobs[0]
    fresh = run_wire(engines[1], [item("run-a", [text_row], forward_only=True)])[0].logprobs[0]
    np.testing.assert_array_equal(after, fresh)
    want, _ = direct(engines[1], "run-a", decode(engines[1], [text_row]), with_grad=False)
    np.testing.assert_allclose(after, want[0], atol=1e-5, rtol=0)


def snapshot(engine, run_id):
    adapter = engine.host.get(run_id)
    return {name: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for name, p in adapter.params.items()}


def assert_unchanged(before, after):
    assert before.keys() == after.keys()
    for name, (weight, grad) in before.items():
        assert torch.equal(weight, after[name][0]) and (grad is None) == (after[name][1] is None)
        if grad is not None:
            assert torch.equal(grad, after[name][1])


def test_expected_tokens_mismatch_is_refused_naming_both_numbers_and_changes_nothing(vl_model_dirs, tmp_path):
    engine = make_engine(vl_model_dirs["qwen3_vl"], tmp_path)
    add_adapter(engine, "run-a", True, seed=1)
    vision = engine.loaded.vision
    run_wire(engine, [item("run-a", sample_data(vision)[:1])])  # some gradient to keep
    before = snapshot(engine, "run-a")
    bad = types_pb2.Datum(model_input=types_pb2.ModelInput(chunks=[text([1]), image(noise_png(1), expected=5)]),
                          loss_fn_inputs={"target_tokens": encode_array(np.zeros(5), "int64"),
                                          "weights": encode_array(np.ones(5), "float32")})
    (result,) = run_wire(engine, [item("run-a", sample_data(vision)[:1] + [bad])])
    assert isinstance(result, InvalidArgument)
    assert "expected_tokens is 5" in result.message and "makes 4 image tokens" in result.message
    assert_unchanged(before, snapshot(engine, "run-a"))


def test_a_text_only_trainer_refuses_images_and_train_vision_changing_nothing(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path)
    spec, seed = convert.adapter_from_pb(types_pb2.LoraConfig(rank=4, train_attn=True), 8.0, engine.lora)
    engine.create_adapter("run-a", spec, seed)
    before = snapshot(engine, "run-a")
    with_image = types_pb2.Datum(model_input=types_pb2.ModelInput(chunks=[text([1, 2]), image(noise_png(1), 4)]),
                                 loss_fn_inputs={"target_tokens": encode_array(np.zeros(6), "int64"),
                                                 "weights": encode_array(np.ones(6), "float32")})
    (result,) = run_wire(engine, [item("run-a", [with_image])])
    assert isinstance(result, InvalidArgument) and "takes text only" in result.message
    assert_unchanged(before, snapshot(engine, "run-a"))
    with pytest.raises(InvalidArgument, match="train_vision needs a vision-language base model"):
        convert.adapter_from_pb(types_pb2.LoraConfig(rank=4, train_attn=True, train_vision=True), 8.0, engine.lora)
    assert set(engine.host.adapters) == {"run-a"}
    assert not convert.model_info_to_pb(engine.loaded, "cpu", "float32").HasField("vision")


@pytest.mark.parametrize("family", FAMILIES)
def test_model_info_train_vision_and_deterministic_mode_of_a_vision_trainer(vl_model_dirs, tmp_path, family):
    engine = make_engine(vl_model_dirs[family], tmp_path)
    info = convert.model_info_to_pb(engine.loaded, "cpu", "float32", deterministic_unsupported=engine.deterministic_unsupported)
    assert info.vision.image_token_id == engine.loaded.vision.tokens.image == 151655
    assert json.loads(info.vision.image_processor_json)["merge_size"] == 2
    assert family in info.deterministic_unsupported
    plain, _ = convert.adapter_from_pb(types_pb2.LoraConfig(rank=4, train_attn=True, train_mlp=True), 8.0, engine.lora)
    tower, _ = convert.adapter_from_pb(types_pb2.LoraConfig(rank=4, train_attn=True, train_mlp=True, train_vision=True),
                                       8.0, engine.lora)
    assert set(tower.targets) - set(plain.targets) == {"qkv", "proj", "linear_fc1", "linear_fc2"}
    if family == "qwen3_vl_moe":
        assert "mlp.experts.gate_up_proj" in plain.targets
        assert {type(e.base).__name__ for e in engine.lora.experts.values()} == {"Qwen3VLMoeTextExperts"}
    engine.create_adapter("run-a", plain, 1)
    before = snapshot(engine, "run-a")
    decoded = convert.forward_backward_from_pb(item("run-a", sample_data(engine.loaded.vision)[:1]), engine.loaded.vocab_size,
                                               None, engine.loaded.vision)
    decoded.deterministic = True
    (result,), _ = engine.run_cycle([decoded], [])
    assert isinstance(result, FailedPrecondition) and family in result.message
    assert_unchanged(before, snapshot(engine, "run-a"))
    # a rank of a sharded trainer group refuses images by name
    engine.sharded, engine.world_size = object(), 2
    decoded.deterministic = False
    (result,), _ = engine.run_cycle([decoded], [])
    assert isinstance(result, FailedPrecondition) and "sharded trainer group (2 ranks) does not take images" in result.message
    assert_unchanged(before, snapshot(engine, "run-a"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("train_vision", [False, True])
def test_peft_export_loads_into_transformers_and_peft_and_matches_on_images(vl_model_dirs, tmp_path, family, train_vision):
    check_peft_export_matches_on_images(vl_model_dirs[family], tmp_path, train_vision)
