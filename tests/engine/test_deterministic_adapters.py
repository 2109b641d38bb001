"""Deterministic decode of a batch mixing adapters (docs/deterministic.md): the decode steps run the
adapters of one rank stacked over all rows (services/lora/deterministic_lora.py) and each prompt's
prefill once for all its samples; each sampled token's logprob must still be torch.equal to its run's
trainer forward, and each request's tokens and logprobs the same batched as alone."""

import numpy as np
import torch

from test_trainer_engine import fb, sft
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import TrainerEngine
from temper.services.trainer.settings import TrainerSettings

# two ranks (two stacked buckets), three scales, and layers that only some adapters adapt
SPECS = {"wide": AdapterSpec(rank=8, alpha=32.0, targets=lora_targets(attn=True, mlp=True, unembed=True)),
         "narrow": AdapterSpec(rank=4, alpha=8.0, targets=lora_targets(attn=True, mlp=True, unembed=True)),
         "mlp": AdapterSpec(rank=4, alpha=4.0, targets=lora_targets(mlp=True))}


def test_mixed_adapter_batch_equals_each_runs_trainer_forward(tiny_model_dir, tmp_path, one_torch_thread):
    from temper.services.sampler.backend import SampleRequest, SamplingOptions
    from temper.services.sampler.torch_backend import TorchSamplerBackend

    engine = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(checkpoint_dir=tmp_path / "ckpt"))
    sampler = TorchSamplerBackend(load_model(tiny_model_dir))
    for seed, (run, spec) in enumerate(SPECS.items()):
        engine.create_adapter(run, spec, seed)
        with torch.no_grad():  # trained-looking adapters: B != 0
            for name, p in engine.host.get(run).params.items():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed * 1000 + len(name)))
        engine.save(run, f"t/{run}/ckpt", include_optimizer=False)
        sampler.load_adapter(run, engine.store.existing(f"t/{run}/ckpt"))
    rng = np.random.default_rng(5)
    # (adapter or None for the base model, prompt length, samples): rows of one adapter apart in the batch
    asks = [("wide", 7, 2), ("mlp", 66, 1), (None, 12, 2), ("narrow", 30, 3), ("wide", 3, 1)]
    prompts = [rng.integers(0, 512, n) for _, n, _ in asks]

    def requests():
        return [SampleRequest(key, p, n, SamplingOptions(max_tokens=10, seed=k, stop_disabled=True), deterministic=True)
                for k, ((key, _, n), p) in enumerate(zip(asks, prompts))]

    batched = sampler.sample_batch(requests())
    for k, ((run, _, _), prompt, result) in enumerate(zip(asks, prompts, batched)):
        alone = sampler.sample_batch([requests()[k]])[0]
        assert [(s.tokens, s.logprobs) for s in result.sequences] == [(s.tokens, s.logprobs) for s in alone.sequences]
        if run is None:
            continue
        data = [sft(prompt.tolist() + s.tokens, np.ones(len(prompt) + len(s.tokens) - 1, np.float32)) for s in result.sequences]
        trained, _ = engine.run_cycle([fb(run, data, forward_only=True, deterministic=True)], [])
        for seq, lp in zip(result.sequences, trained[0].logprobs):
            assert torch.equal(torch.tensor(seq.logprobs, dtype=torch.float32), torch.from_numpy(lp[len(prompt) - 1:]))


def test_forward_only_equals_forward_backward_logprobs(tiny_model_dir, tmp_path, one_torch_thread):
    """A no-grad pass of few rows adds its adapter through the stacked batched matmuls, a pass with
    gradients through per-adapter matmuls: the logprobs are the same bits (what a sampler's logprobs
    are compared with in RL is the trainer's forward_backward)."""
    engine = TrainerEngine(load_model(tiny_model_dir), TrainerSettings(checkpoint_dir=tmp_path / "ckpt"))
    engine.create_adapter("wide", SPECS["wide"], 1)
    with torch.no_grad():
        for name, p in engine.host.get("wide").params.items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    rng = np.random.default_rng(6)
    data = [sft(rng.integers(0, 512, n).tolist(), np.ones(n - 1, np.float32)) for n in (3, 9, 40, 65, 90)]
    forward, _ = engine.run_cycle([fb("wide", data, forward_only=True, deterministic=True)], [])
    backward, _ = engine.run_cycle([fb("wide", data, deterministic=True)], [])
    assert len(forward[0].logprobs) == len(data)
    for a, b in zip(forward[0].logprobs, backward[0].logprobs):
        assert torch.equal(torch.from_numpy(a), torch.from_numpy(b))
