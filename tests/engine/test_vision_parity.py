"""Trainer/sampler parity on image prompts (issue 30 part 5: within 1e-5 in fp32), on both tiny
vision-language families. An adapter of the language model and the vision tower (train_vision) is
trained for two steps (its B factors no longer zero), saved by the trainer engine as it saves for a
sampler (peft format) and loaded into the torch sampler backend, as a pushed checkpoint is. On prompts
with one image, two images and none, in one batch: the trainer's forward logprobs (forward_only
cross_entropy, target = the next token) equal the sampler's compute_logprobs and its prompt logprobs,
and both equal the saved adapter on vanilla transformers + peft (the direct torch computation)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch

from temper.common.codec import decode_tokens, encode_array, encode_tokens
from temper.services.models import images as image_path
from temper.services.models.loading import load_model
from temper.services.sampler.backend import SampleRequest, SamplingOptions
from temper.services.sampler.torch_backend import TorchSamplerBackend
from temper.services.trainer import convert
from temper.services.trainer.engine import AdamParams, OptimStepItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2, types_pb2

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
TOL = 1e-5
ADAM = AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)
GREEDY = SamplingOptions(max_tokens=1, temperature=0.0, stop_disabled=True)
RUN = "run-v"


def noise_png(seed: int, size=(64, 64)) -> bytes:
    """Random noise (solid colours would look alike to the tower)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def text(tokens) -> types_pb2.ModelInputChunk:
    return types_pb2.ModelInputChunk(encoded_text=types_pb2.EncodedTextChunk(tokens=encode_tokens(tokens)))


def prompt(vision, *pieces) -> types_pb2.ModelInput:
    """Token lists and image bytes in order; each image between vision start and end tokens."""
    chunks = []
    for piece in pieces:
        if isinstance(piece, bytes):
            chunks += [text([vision.tokens.start]),
                       types_pb2.ModelInputChunk(image=types_pb2.ImageChunk(data=piece, format="png")),
                       text([vision.tokens.end])]
        else:
            chunks.append(text(piece))
    return types_pb2.ModelInput(chunks=chunks)


def prompts(vision) -> list[types_pb2.ModelInput]:
    """One image, two images (one of another size), text only; each ends with text."""
    return [prompt(vision, [11, 12, 13], noise_png(1), [14, 15, 16]),
            prompt(vision, [21], noise_png(2), [22, 23], noise_png(3, (96, 64)), [24, 25, 26]),
            prompt(vision, [31, 32, 33, 34, 35, 36, 37, 38])]


def next_token_datum(model_input: types_pb2.ModelInput, flat_tokens: np.ndarray) -> types_pb2.Datum:
    """The prompt less its last token as input (it ends with text), the next token as target (Tinker's shift)."""
    *head, last = model_input.chunks
    kept = decode_tokens(last.encoded_text.tokens).tolist()[:-1]
    shifted = types_pb2.ModelInput(chunks=[*head, text(kept)] if kept else head)
    targets = np.asarray(flat_tokens[1:], dtype=np.int64)
    return types_pb2.Datum(model_input=shifted, loss_fn_inputs={"target_tokens": encode_array(targets, "int64"),
                                                                "weights": encode_array(np.ones(len(targets), np.float32),
                                                                                        "float32")})


def item(data, forward_only: bool) -> trainer_pb2.ForwardBackwardItem:
    return trainer_pb2.ForwardBackwardItem(training_run_id=RUN, data=data, loss_fn="cross_entropy", forward_only=forward_only)


def cycle(engine, items, steps=()):
    loaded = engine.loaded
    decoded, _ = convert.cycle_from_pb(trainer_pb2.CycleRequest(forward_backward=items), loaded.vocab_size,
                                       loaded.max_context_length, loaded.vision, engine.image_limits, loaded.name)
    results, stepped = engine.run_cycle(decoded, list(steps))
    for result in [*results, *stepped]:
        assert not isinstance(result, Exception), result
    return results


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, vl_model_dirs, tmp_path_factory):
    """(family folder, trainer engine with RUN trained two steps on image rows, the saved adapter's folder)."""
    folder = vl_model_dirs[request.param]
    tmp = tmp_path_factory.mktemp(f"parity-{request.param}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = TrainerEngine(load_model(folder), TrainerSettings(checkpoint_dir=tmp / "ckpt", offload_dir=tmp / "offload"))
    spec, seed = convert.adapter_from_pb(types_pb2.LoraConfig(rank=4, alpha=8.0, seed=5, train_attn=True, train_mlp=True,
                                                              train_vision=True), 8.0, engine.lora)
    adapter = engine.create_adapter(RUN, spec, seed)
    vision = engine.loaded.vision
    train = [next_token_datum(p, image_path.flatten(p, vision).tokens) for p in prompts(vision)]
    for _ in range(2):
        cycle(engine, [item(train, forward_only=False)], [OptimStepItem(RUN, ADAM, seq_id=0)])
    params = dict(adapter.params)
    assert any(".visual." in name for name in params) and any("lora_B" in name for name in params)
    assert all(p.abs().sum() > 0 for p in params.values())  # every factor moved, B (zero at creation) included
    engine.save(RUN, "tenant/run-v/sampler", include_optimizer=False)
    return folder, engine, engine.store.existing("tenant/run-v/sampler")


@pytest.fixture(scope="module")
def sampler(trained):
    folder, _, adapter_dir = trained
    backend = TorchSamplerBackend(load_model(folder))
    backend.load_adapter("ckpt", adapter_dir)
    return backend


def test_trainer_and_sampler_logprobs_on_image_prompts_agree_within_1e_5(trained, sampler):
    folder, engine, adapter_dir = trained
    vision = engine.loaded.vision
    inputs = prompts(vision)
    flats = [image_path.flatten(p, vision) for p in inputs]
    assert [len(f.images) for f in flats] == [1, 2, 0]
    # the trainer: one forward_only item, the three rows co-batched
    (forward,) = cycle(engine, [item([next_token_datum(p, f.tokens) for p, f in zip(inputs, flats)], forward_only=True)])
    trainer_lp = [np.asarray(lp, dtype=np.float64) for lp in forward.logprobs]
    # the sampler: prompt logprobs of the three in one batch, and compute_logprobs of each
    batch = sampler.sample_batch([SampleRequest("ckpt", f.tokens, 1, GREEDY, prompt_logprobs=True, images=f.images)
                                  for f in flats])
    direct, without_tower = peft_logprobs(folder, adapter_dir, vision, flats)
    diffs = {"trainer-vs-compute_logprobs": 0.0, "trainer-vs-prompt_logprobs": 0.0, "trainer-vs-peft": 0.0}
    for f, got_trainer, result, want in zip(flats, trainer_lp, batch, direct):
        scored = sampler.compute_logprobs("ckpt", f.tokens, images=f.images)
        assert scored.shape == result.prompt_logprobs.shape == (len(f.tokens),)  # one per token, N per image
        assert np.isnan(scored[0]) and np.isnan(result.prompt_logprobs[0]) and got_trainer.shape == (len(f.tokens) - 1,)
        for name, other in [("trainer-vs-compute_logprobs", scored[1:]),
                            ("trainer-vs-prompt_logprobs", result.prompt_logprobs[1:]), ("trainer-vs-peft", want)]:
            np.testing.assert_allclose(got_trainer, other, atol=TOL, rtol=0, err_msg=name)
            diffs[name] = max(diffs[name], float(np.abs(got_trainer - other).max()))
    print(f"\n{engine.loaded.model.config.model_type}: max abs diffs {diffs}")
    # what is compared matters far beyond the tolerance: the adapter (the base model's logprobs differ), and
    # on the image rows its tower LoRA (zeroed, the rows differ; the text-only row has no image to change)
    base = sampler.compute_logprobs(None, flats[0].tokens, images=flats[0].images)
    assert np.abs(base[1:] - trainer_lp[0]).max() > 1e-3
    tower_effect = [float(np.abs(a - b).max()) for a, b in zip(direct, without_tower)]
    print(f"tower LoRA effect per row (max abs): {tower_effect}")
    assert min(tower_effect[:2]) > 100 * TOL and tower_effect[2] == 0.0


def peft_logprobs(folder, adapter_dir, vision, flats) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """log p(next token) of each row from the saved adapter on vanilla transformers + peft, one row at a
    time (pixel_values from the model's processor, positions computed by the model itself); and the same
    with the vision tower's LoRA B factors zeroed (what a path that skipped the tower's LoRA would give)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()

    def rows():
        out = []
        for f in flats:
            ids = torch.tensor(np.asarray(f.tokens, dtype=np.int64))[None]
            kwargs = dict(vision.pixels(list(f.images)), mm_token_type_ids=(ids == vision.tokens.image).int()) if f.images else {}
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0].float()
            out.append(logits.log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0].double().numpy())
        return out

    full = rows()
    tower_b = [p for name, p in model.named_parameters() if ".visual." in name and "lora_B" in name]
    assert tower_b
    with torch.no_grad():
        for p in tower_b:
            p.zero_()
    return full, rows()
