"""Deterministic mode on the engine (docs/deterministic.md): a deterministic run's numbers are
torch.equal whoever shares its passes, whatever the micro-batch split; the KV-cached decode of the
batch-invariant primitives is torch.equal to the trainer's forward; two fresh engines agree bit for
bit; a family without batch-invariant kernels is refused by name."""

import numpy as np
import pytest
import torch

from test_trainer_engine import fb, sft
from temper.common.errors import FailedPrecondition
from temper.services.lora import deterministic as det
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import AdamParams, OptimStepItem, TrainerEngine
from temper.services.trainer.settings import TrainerSettings

SPEC = AdapterSpec(rank=4, alpha=8.0, targets=lora_targets(attn=True, mlp=True, unembed=True))
DETERMINISTIC = {"det-short": (3, 1), "det-mid": (11, 2), "det-long": (29, 3)}  # run -> (tokens per datum, seed)
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
STEPS = 3


def engine_for(model_dir, path, runs, **settings):
    engine = TrainerEngine(load_model(model_dir), TrainerSettings(checkpoint_dir=path / "ckpt", **settings))
    for run in runs:
        engine.create_adapter(run, SPEC, DETERMINISTIC.get(run, (0, 9))[1])
    return engine


def trainer_and_sampler(model_dir, path):
    """A trainer engine with run "run" (its lora_B made non-zero, so the adapter matters) and a torch
    sampler backend holding that adapter as checkpoint "ckpt-1"."""
    from temper.services.sampler.torch_backend import TorchSamplerBackend

    engine = engine_for(model_dir, path, ["run"])
    with torch.no_grad():
        for name, p in engine.host.get("run").params.items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    engine.save("run", "t/run/ckpt-1", include_optimizer=False)
    sampler = TorchSamplerBackend(load_model(model_dir))
    sampler.load_adapter("ckpt-1", engine.store.existing("t/run/ckpt-1"))
    return engine, sampler


def items(run, step):
    rng = np.random.default_rng(1000 * step + DETERMINISTIC.get(run, (17, 9))[1])
    length = DETERMINISTIC.get(run, (17, 9))[0]
    data = [sft(rng.integers(0, 512, length + k).tolist(), rng.standard_normal(length + k - 1).astype(np.float32))
            for k in range(3)]
    return fb(run, data, deterministic=run in DETERMINISTIC)


def train(engine, runs, steps=STEPS):
    """Losses and logprobs of every step, the gradients before each optim step."""
    seen = {run: [] for run in runs}
    for step in range(steps):
        results, _ = engine.run_cycle([items(run, step) for run in runs], [])
        for run, result in zip(runs, results):
            grads = {n: p.grad.clone() for n, p in engine.host.get(run).params.items()}
            seen[run].append((result.metrics["loss:sum"], [torch.from_numpy(lp) for lp in result.logprobs], grads))
        _, steps_done = engine.run_cycle([], [OptimStepItem(run, ADAM) for run in runs])
        assert all(isinstance(s, dict) for s in steps_done)
    return seen


def state(engine, run):
    adapter = engine.host.get(run)
    weights = {n: p.detach().clone() for n, p in adapter.params.items()}
    adam = {n: {k: v.clone() for k, v in adapter.optimizer.state[p].items()} for n, p in adapter.params.items()}
    return weights, adam


def assert_same(a, b):
    loss_a, lps_a, grads_a = a
    loss_b, lps_b, grads_b = b
    assert loss_a == loss_b
    assert all(torch.equal(x, y) for x, y in zip(lps_a, lps_b))
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_co_batched_equals_solo_three_tenants(tiny_model_dir, tmp_path, one_torch_thread):
    runs = [*DETERMINISTIC, "default"]
    # co-batched with a default run, passes split at 24 tokens; solo with the trainer's usual split
    together = engine_for(tiny_model_dir, tmp_path / "together", runs, max_tokens_per_microbatch=24)
    shared = train(together, runs)
    for run in DETERMINISTIC:
        alone = engine_for(tiny_model_dir, tmp_path / run, [run])
        solo = train(alone, [run])
        for step in range(STEPS):
            assert_same(shared[run][step], solo[run][step])
        (w_a, adam_a), (w_b, adam_b) = state(together, run), state(alone, run)
        assert all(torch.equal(w_a[n], w_b[n]) for n in w_a)
        assert all(torch.equal(adam_a[n][k], adam_b[n][k]) for n in adam_a for k in adam_a[n])
        assert any(len(adam_a[n]) for n in adam_a)  # Adam did step


def test_deterministic_rows_differ_only_in_bits_from_default(tiny_model_dir, tmp_path, one_torch_thread):
    """The deterministic pass is the same math: default and deterministic logprobs are close."""
    engine = engine_for(tiny_model_dir, tmp_path, ["det-mid"])
    item = items("det-mid", 0)
    exact, _ = engine.run_cycle([item], [])
    item.deterministic, item.forward_only = False, True
    usual, _ = engine.run_cycle([item], [])
    for a, b in zip(exact[0].logprobs, usual[0].logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_run_to_run(tiny_model_dir, tmp_path, one_torch_thread):
    first = train(engine_for(tiny_model_dir, tmp_path / "a", ["det-long"]), ["det-long"], 2)
    second = train(engine_for(tiny_model_dir, tmp_path / "b", ["det-long"]), ["det-long"], 2)
    for a, b in zip(first["det-long"], second["det-long"]):
        assert_same(a, b)


def decode_logprobs(lora, key, sequences, prefill):
    """Teacher-forced KV-cached decode of ``sequences`` batched: prefill ``prefill`` tokens, then one
    token a step; log p of each following token."""
    model, rows = lora.model, len(sequences)
    width = max(len(s) for s in sequences)
    cache = det.DecodeCache(rows, width + 1)
    out = [[] for _ in sequences]
    with det.deterministic(model, cache), lora.route([(key, torch.arange(rows))]), torch.no_grad():
        ids = torch.stack([s[:prefill] for s in sequences])
        logits = model(input_ids=ids, position_ids=torch.arange(prefill)[None].expand(rows, -1)).logits[:, -1].float()
        for t in range(prefill, width):
            nxt = torch.tensor([int(s[t]) if t < len(s) else 0 for s in sequences])
            lp = det.target_logprobs(logits, nxt[:, None])[:, 0]
            for b, s in enumerate(sequences):
                if t < len(s):
                    out[b].append(lp[b])
            logits = model(input_ids=nxt[:, None], position_ids=torch.full((rows, 1), t)).logits[:, -1].float()
    return [torch.stack(o) for o in out]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_decode_with_kv_cache_equals_trainer_forward(family, family_dirs, tmp_path, one_torch_thread):
    engine = TrainerEngine(load_model(str(family_dirs[family])), TrainerSettings(checkpoint_dir=tmp_path / "ckpt"))
    engine.create_adapter("run", SPEC, 5)
    with torch.no_grad():  # a trained-looking adapter: B != 0
        for name, p in engine.host.get("run").params.items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    rng = np.random.default_rng(0)
    sequences = [torch.from_numpy(rng.integers(0, 512, n)) for n in (9, 70, 130)]  # keys across 64-key blocks
    forward = []
    for s in sequences:
        item = fb("run", [sft(s.tolist() + [0], np.ones(len(s), np.float32))], forward_only=True, deterministic=True)
        result, _ = engine.run_cycle([item], [])
        forward.append(torch.from_numpy(result[0].logprobs[0]))
    prefill = 4
    alone = [decode_logprobs(engine.lora, "run", [s], prefill)[0] for s in sequences]
    batched = decode_logprobs(engine.lora, "run", sequences, prefill)
    for f, a, b in zip(forward, alone, batched):
        assert torch.equal(a, f[prefill - 1:-1])
        assert torch.equal(b, f[prefill - 1:-1])


def test_family_without_batch_invariant_kernels_refused(family_dirs, tmp_path, one_torch_thread):
    engine = TrainerEngine(load_model(str(family_dirs["qwen3_moe"])), TrainerSettings(checkpoint_dir=tmp_path / "ckpt"))
    engine.create_adapter("moe", AdapterSpec(rank=4, alpha=8.0, targets=engine.lora.group_targets(attn=True)), 1)
    before = {n: p.detach().clone() for n, p in engine.host.get("moe").params.items()}
    results, _ = engine.run_cycle([fb("moe", [sft([1, 2, 3, 4], np.ones(3, np.float32))], deterministic=True)], [])
    assert isinstance(results[0], FailedPrecondition) and "qwen3_moe" in str(results[0])
    adapter = engine.host.get("moe")
    assert all(p.grad is None for p in adapter.params.values())
    assert all(torch.equal(before[n], p) for n, p in adapter.params.items())


def test_torch_sampler_deterministic_logprobs_are_the_trainers(tiny_model_dir, tmp_path, one_torch_thread):
    from temper.services.sampler.backend import SampleRequest, SamplingOptions

    engine, sampler = trainer_and_sampler(tiny_model_dir, tmp_path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, n) for n in (5, 40, 90)]
    options = SamplingOptions(max_tokens=20, seed=7, stop_disabled=True)

    def request(prompt, n=2):
        return SampleRequest("ckpt-1", prompt, n, options, deterministic=True)

    batched = sampler.sample_batch([request(p) for p in prompts] + [SampleRequest(None, prompts[0], 1, options)])
    for prompt, result in zip(prompts, batched):
        alone = sampler.sample_batch([request(prompt)])[0]
        for seq, solo in zip(result.sequences, alone.sequences):
            assert seq.tokens == solo.tokens and seq.logprobs == solo.logprobs  # batch-invariant, seeded
            tokens = prompt.tolist() + seq.tokens
            item = fb("run", [sft(tokens, np.ones(len(tokens) - 1, np.float32))], forward_only=True, deterministic=True)
            trained, _ = engine.run_cycle([item], [])
            assert torch.equal(torch.tensor(seq.logprobs, dtype=torch.float32),
                               torch.from_numpy(trained[0].logprobs[0][len(prompt) - 1:]))
    again = sampler.sample_batch([request(p) for p in prompts])
    assert [[s.tokens for s in r.sequences] for r in again] == [[s.tokens for s in r.sequences] for r in batched[:3]]


@pytest.fixture
def two_torch_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_threaded_passes_equal_one_at_a_time(tiny_model_dir, tmp_path, two_torch_threads):
    """Deterministic passes two at a time on two threads (gradients by autograd.grad, added in datum
    order) give the bits of one at a time: 5 datums of different lengths, gradients accumulated over
    two cycles onto absent and then present .grad, a forward-only item and a default run beside, in a
    process of two intra-op threads (the default run's passes use both; each deterministic pass one)."""
    from dataclasses import replace

    from temper.services.trainer import numerics

    lengths = (4, 37, 9, 70, 18)

    def cycle_items(step):
        rng = np.random.default_rng(step)
        data = [sft(rng.integers(0, 512, n).tolist(), rng.standard_normal(n - 1).astype(np.float32)) for n in lengths]
        return [fb("det", data, deterministic=True), fb("det-fwd", data[:3], deterministic=True, forward_only=True),
                items("default", step)]

    def run(workers, folder):
        engine = engine_for(tiny_model_dir, tmp_path / folder, ["det", "det-fwd", "default"])

        def passes(groups, options):
            return numerics.forward_backward(engine.lora, groups, replace(options, deterministic_workers=workers),
                                             engine.device)

        engine.passes = passes
        seen = []
        for step in range(2):
            for sub in range(2):  # two cycles before the optim step: the second adds onto present .grad
                results, _ = engine.run_cycle(cycle_items(2 * step + sub), [])
                grads = {n: p.grad.clone() for n, p in engine.host.get("det").params.items()}
                seen.append(([r.metrics["loss:sum"] for r in results],
                             [torch.from_numpy(lp) for r in results for lp in r.logprobs], grads))
            engine.run_cycle([], [OptimStepItem(r, ADAM) for r in ("det", "default")])
        return seen, state(engine, "det")

    (threaded, (w_t, adam_t)), (sequential, (w_s, adam_s)) = run(2, "threaded"), run(1, "sequential")
    assert torch.get_num_threads() == 2  # the deterministic scopes gave the process its threads back
    for a, b in zip(threaded, sequential):
        assert a[0] == b[0]
        assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])
    assert all(torch.equal(w_t[n], w_s[n]) for n in w_t)
    assert all(torch.equal(adam_t[n][k], adam_s[n][k]) for n in adam_t for k in adam_t[n])
    assert any(len(adam_t[n]) for n in adam_t)


def test_threaded_decode_parts_equal_one_batch(tiny_model_dir, tmp_path, two_torch_threads):
    """A deterministic decode batch split into two parts decoded on two threads (each on one intra-op
    thread, 16 rows each) gives the bits of one batch on the calling thread, and the
    sampled tokens' logprobs are the trainer's forward; streamed pieces come from the worker threads."""
    from temper.services.sampler import deterministic_decode
    from temper.services.sampler.backend import SampleRequest, SamplingOptions
    from temper.services.sampler.torch_backend import _choose

    engine, sampler = trainer_and_sampler(tiny_model_dir, tmp_path)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 512, n) for n in (5, 40, 90, 17)]
    streamed: dict = {}

    def requests():
        streamed.clear()
        return [SampleRequest("ckpt-1" if n % 2 == 0 else None, p, 8, SamplingOptions(max_tokens=12 + n, seed=n, stop_disabled=True),
                              topk_logprobs=3 * (n == 1), deterministic=True,
                              progress=(lambda pieces, n=n: streamed.setdefault(n, []).extend(pieces)) if n == 2 else None)
                for n, p in enumerate(prompts)]

    assert len(deterministic_decode._split(requests(), 2)) == 2
    split = deterministic_decode.sample(sampler, requests(), _choose, workers=2)
    pieces = list(streamed[2])
    one = deterministic_decode.sample(sampler, requests(), _choose, workers=1)
    assert len(pieces) == len(streamed[2]) and all(a.tokens == b.tokens and a.logprobs == b.logprobs
                                                   for a, b in zip(pieces, streamed[2]))
    for n, (a, b) in enumerate(zip(split, one)):
        for x, y in zip(a.sequences, b.sequences):
            assert x.tokens == y.tokens and x.logprobs == y.logprobs and x.topk_ids == y.topk_ids and x.topk_logprobs == y.topk_logprobs
        if n % 2 == 0:  # the adapter's rows: the trainer's forward
            for seq in a.sequences[:2]:
                tokens = prompts[n].tolist() + seq.tokens
                item = fb("run", [sft(tokens, np.ones(len(tokens) - 1, np.float32))], forward_only=True, deterministic=True)
                trained, _ = engine.run_cycle([item], [])
                assert torch.equal(torch.tensor(seq.logprobs, dtype=torch.float32),
                                   torch.from_numpy(trained[0].logprobs[0][len(prompts[n]) - 1:]))
    assert torch.get_num_threads() == 2
