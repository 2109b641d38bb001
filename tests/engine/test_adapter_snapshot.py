"""Adapter snapshots (services/trainer/snapshots.py): a run's whole training state written by one engine
and restored into a fresh one on the same tiny model, sharing the checkpoint folder, continues bit
for bit: the same losses, logprobs, metrics, weights, gradients and Adam state as the original for
the same next requests. Resent seqs are answered from memory after a restore; an offloaded adapter
snapshots as it is; a snapshot that does not fit is refused with nothing changed."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch

from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from temper.common.validation import DecodedDatum
from temper.services.lora.model import AdapterSpec
from temper.services.models.loading import load_model
from temper.services.models.tiny import build_tiny_model
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import AdamParams, ForwardBackwardItem, ForwardBackwardResult, OptimStepItem, TrainerEngine
from temper.services.trainer.servicer import TrainerServicer
from temper.services.trainer.settings import TrainerSettings
from temper.v1 import trainer_pb2

SPEC = AdapterSpec(rank=4, alpha=32.0, targets=lora_targets(attn=True, mlp=True, unembed=True))
KEY = "run-a/snapshots/s1"
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


def make_engine(model_dir, tmp_path, name: str, dtype: str = "float32", **settings) -> TrainerEngine:
    """An engine of its own (its own copy of the model) on the shared checkpoint folder."""
    settings = TrainerSettings(checkpoint_dir=tmp_path / "ckpt", offload_dir=tmp_path / f"offload-{name}",
                               logprob_chunk_tokens=5, max_tokens_per_microbatch=24, **settings)
    return TrainerEngine(load_model(str(model_dir), dtype=dtype), settings)


def data(seed: int, n: int = 3, zero_weights: bool = False) -> list[DecodedDatum]:
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(4, 12, n):
        tokens = rng.integers(0, 512, length)
        weights = np.zeros(length - 1, np.float32) if zero_weights else rng.standard_normal(length - 1).astype(np.float32)
        out.append(DecodedDatum(tokens=tokens[:-1].astype(np.int32),
                                inputs={"target_tokens": tokens[1:].astype(np.int64), "weights": weights}))
    return out


def fb(run_id: str, seq: int, seed: int, forward_only: bool = False, zero_weights: bool = False) -> ForwardBackwardItem:
    return ForwardBackwardItem(run_id=run_id, data=data(seed, zero_weights=zero_weights), seq_id=seq, forward_only=forward_only)


def step(run_id: str, seq: int, lr: float = 1e-2) -> OptimStepItem:
    return OptimStepItem(run_id=run_id, adam=AdamParams(**{**ADAM.__dict__, "learning_rate": lr}), seq_id=seq)


def train_with_pending_gradients(engine: TrainerEngine) -> None:
    """run-a: two steps (co-batched with run-b's), then a forward_backward after the last step: seqs 1-5."""
    engine.create_adapter("run-a", SPEC, seed=3)
    engine.create_adapter("run-b", AdapterSpec(rank=2, alpha=8.0, targets=lora_targets(attn=True)), seed=4)
    for seq, lr in ((1, 1e-2), (3, 5e-3)):
        engine.run_cycle([fb("run-a", seq, seed=seq), fb("run-b", seq, seed=10 + seq)],
                         [step("run-a", seq + 1, lr), step("run-b", seq + 1)])
    engine.run_cycle([fb("run-a", 5, seed=5)], [])


def state(engine: TrainerEngine, run_id: str = "run-a") -> dict:
    adapter, flat = engine.host.state_of(run_id)
    return {"tensors": {k: t.clone() for k, t in flat.tensors.items()}, "group": dict(flat.group), "steps": adapter.steps,
            "pending_tokens": adapter.pending_tokens, "applied_seq": adapter.applied_seq, "answers": dict(adapter.answers)}


def assert_same_answer(got, want) -> None:
    if isinstance(want, ForwardBackwardResult):
        assert isinstance(got, ForwardBackwardResult) and got.metrics == want.metrics
        for got_arrays, want_arrays in ((got.logprobs, want.logprobs), (got.elementwise_loss, want.elementwise_loss)):
            assert len(got_arrays) == len(want_arrays)
            for g, w in zip(got_arrays, want_arrays):
                assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
    else:
        assert got == want


def assert_same_state(got: dict, want: dict) -> None:
    """Bit for bit: every tensor (weights, grads and which are None, exp_avg, exp_avg_sq, step), the
    optimizer's hyperparameters, the counters and the remembered answers."""
    assert sorted(got["tensors"]) == sorted(want["tensors"])
    for key, tensor in want["tensors"].items():
        assert got["tensors"][key].dtype == tensor.dtype and torch.equal(got["tensors"][key], tensor), key
    assert got["group"] == want["group"]
    for name in ("steps", "pending_tokens", "applied_seq"):
        assert got[name] == want[name], name
    assert list(got["answers"]) == list(want["answers"])
    for seq, answer in want["answers"].items():
        assert_same_answer(got["answers"][seq], answer)


def assert_same_cycle(a: TrainerEngine, b: TrainerEngine, forward_backward, optim_step) -> None:
    got_a, got_b = a.run_cycle(forward_backward, optim_step), b.run_cycle(forward_backward, optim_step)
    for outcomes_a, outcomes_b in zip(got_a, got_b):
        for outcome_a, outcome_b in zip(outcomes_a, outcomes_b):
            assert not isinstance(outcome_a, Exception), outcome_a
            assert_same_answer(outcome_b, outcome_a)


@pytest.fixture
def original(tiny_model_dir, tmp_path) -> TrainerEngine:
    engine = make_engine(tiny_model_dir, tmp_path, "a")
    train_with_pending_gradients(engine)
    return engine


def test_a_restored_run_continues_bit_for_bit_like_the_original(original, tiny_model_dir, tmp_path):
    before = state(original)
    assert before["steps"] == 2 and before["applied_seq"] == 5 and before["pending_tokens"] > 0
    assert any(k.startswith("grad/") for k in before["tensors"]) and any(k.startswith("exp_avg/") for k in before["tensors"])
    info = original.snapshot("run-a", KEY)
    folder = original.store.path(KEY)
    assert (info.applied_seq, info.steps) == (5, 2)
    assert info.size_bytes == sum(f.stat().st_size for f in folder.iterdir())
    assert sorted(f.name for f in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                       "answers.safetensors", "snapshot.json", "training_state.safetensors"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging folder left
    assert_same_state(state(original), before)  # taking it changed nothing

    fresh = make_engine(tiny_model_dir, tmp_path, "b")
    assert not fresh.host.adapters
    assert tuple(fresh.restore("run-a", KEY))[1:] == (5, 2)
    assert_same_state(state(fresh), before)

    # the same next requests: a step that takes the pending gradients, a pass left pending, a forward
    assert_same_cycle(original, fresh, [fb("run-a", 6, seed=6)], [step("run-a", 7, 2e-3)])
    assert_same_cycle(original, fresh, [fb("run-a", 8, seed=8)], [])
    assert_same_cycle(original, fresh, [fb("run-a", 9, seed=9, forward_only=True)], [step("run-a", 10)])
    assert_same_cycle(original, fresh, [fb("run-a", 11, seed=11)], [])
    assert_same_state(state(fresh), state(original))
    assert state(fresh)["steps"] == 4

    # restoring replaces the adapter the run has: the original goes back to the snapshot's state
    original.restore("run-a", KEY)
    assert_same_state(state(original), before)
    assert "run-b" in original.host.adapters


def test_resent_seqs_are_answered_from_memory_after_a_restore(original, tiny_model_dir, tmp_path):
    remembered = state(original)["answers"]
    original.snapshot("run-a", KEY)
    fresh = make_engine(tiny_model_dir, tmp_path, "b")
    fresh.restore("run-a", KEY)
    before = state(fresh)
    (answer_fb,), (answer_step,) = fresh.run_cycle([fb("run-a", 5, seed=5)], [step("run-a", 4, 5e-3)])
    assert_same_answer(answer_fb, remembered[5])
    assert_same_answer(answer_step, remembered[4])
    assert answer_step["step:max"] == 2.0
    assert_same_state(state(fresh), before)  # answered, not applied again: gradients not doubled, no third step


@pytest.mark.parametrize("offload_to", ["disk", "host"])
def test_an_offloaded_adapter_snapshots_as_it_is_and_stays_offloaded(tiny_model_dir, tmp_path, offload_to):
    engine = make_engine(tiny_model_dir, tmp_path, "a", max_resident_adapters=1, offload_to=offload_to)
    train_with_pending_gradients(engine)
    engine.run_cycle([fb("run-b", 20, seed=20)], [])  # run-b in, run-a out
    assert engine.host.adapters["run-a"].offloaded is not None and engine.host.resident() == ["run-b"]
    before = state(engine)
    assert any(k.startswith("grad/") for k in before["tensors"])
    assert engine.snapshot("run-a", KEY).applied_seq == 5
    assert engine.host.adapters["run-a"].offloaded is not None and engine.host.resident() == ["run-b"]

    fresh = make_engine(tiny_model_dir, tmp_path, "b")
    fresh.restore("run-a", KEY)
    assert_same_state(state(fresh), before)
    assert_same_cycle(engine, fresh, [fb("run-a", 6, seed=6)], [step("run-a", 7)])  # brings run-a back in
    assert_same_cycle(engine, fresh, [fb("run-a", 8, seed=8)], [])
    assert_same_state(state(fresh), state(engine))

    # a restore replaces an offloaded adapter too
    engine.run_cycle([fb("run-b", 21, seed=21)], [])
    assert engine.host.adapters["run-a"].offloaded is not None
    engine.restore("run-a", KEY)
    assert_same_state(state(engine), before)
    assert not list((tmp_path / "offload-a").glob("run-a*"))  # the replaced adapter's offload file is gone


def test_a_run_without_gradients_round_trips_none_and_zero_gradients_apart(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path, "a")
    fresh = make_engine(tiny_model_dir, tmp_path, "b")
    engine.create_adapter("run-a", SPEC, seed=3)  # never trained: no gradient, no Adam state
    info = engine.snapshot("run-a", "run-a/snapshots/new")
    assert (info.applied_seq, info.steps) == (0, 0)
    fresh.restore("run-a", "run-a/snapshots/new")
    restored = state(fresh)
    assert sorted({k.split("/")[0] for k in restored["tensors"]}) == ["weight"]
    assert all(p.grad is None for p in fresh.host.get("run-a").params.values())
    assert_same_state(restored, state(engine))
    assert_same_cycle(engine, fresh, [fb("run-a", 1, seed=1)], [step("run-a", 2)])

    # after a step the gradients are None (not zeros); a pass with zero weights leaves zero gradients
    engine.snapshot("run-a", "run-a/snapshots/stepped")
    fresh.restore("run-a", "run-a/snapshots/stepped")
    assert all(p.grad is None for p in fresh.host.get("run-a").params.values())
    assert_same_state(state(fresh), state(engine))
    engine.run_cycle([fb("run-a", 3, seed=3, zero_weights=True)], [])
    grads = [p.grad for p in engine.host.get("run-a").params.values()]
    assert all(g is not None and not g.any() for g in grads)
    engine.snapshot("run-a", "run-a/snapshots/zeros")
    fresh.restore("run-a", "run-a/snapshots/zeros")
    assert all(p.grad is not None and not p.grad.any() for p in fresh.host.get("run-a").params.values())
    assert_same_state(state(fresh), state(engine))
    assert_same_cycle(engine, fresh, [fb("run-a", 4, seed=4)], [step("run-a", 5)])
    assert_same_state(state(fresh), state(engine))


def test_a_snapshot_that_does_not_fit_is_refused_with_nothing_changed(original, tiny_model_dir, tmp_path):
    original.snapshot("run-a", KEY)
    original.save("run-a", "run-a/weights/w", include_optimizer=True)
    damaged = original.store.path("run-a/snapshots/damaged")
    shutil.copytree(original.store.path(KEY), damaged)
    blob = bytearray((damaged / "training_state.safetensors").read_bytes())
    blob[-1] ^= 1
    (damaged / "training_state.safetensors").write_bytes(bytes(blob))

    other_dir = build_tiny_model(tmp_path / "other", hidden_size=32)
    other = make_engine(other_dir, tmp_path, "other")
    other.create_adapter("run-a", AdapterSpec(rank=2, alpha=4.0, targets=lora_targets(attn=True)), seed=1)
    other.run_cycle([fb("run-a", 1, seed=1)], [step("run-a", 2)])
    other.run_cycle([fb("run-a", 3, seed=3)], [])
    before = state(other)

    def refused(engine, run_id, key, error, match):
        with pytest.raises(error, match=match):
            engine.restore(run_id, key)
        assert_same_state(state(other), before)

    refused(other, "run-a", KEY, FailedPrecondition, "taken on base model")
    other.lora.base_model_name = original.lora.base_model_name  # same name, another shape
    refused(other, "run-a", KEY, FailedPrecondition, "shapes differ")
    refused(other, "run-a", "run-a/snapshots/damaged", FailedPrecondition, "training_state.safetensors is damaged")
    refused(other, "run-a", "run-a/weights/w", FailedPrecondition, "not an adapter snapshot")
    refused(other, "run-a", "run-a/snapshots/none", NotFound, "not found")
    refused(other, "run-b", KEY, FailedPrecondition, "holds run 'run-a', not 'run-b'")
    assert sorted(other.host.adapters) == ["run-a"]

    bfloat16 = make_engine(tiny_model_dir, tmp_path, "bf16", dtype="bfloat16")
    with pytest.raises(FailedPrecondition, match="float32 base model; this trainer's is bfloat16"):
        bfloat16.restore("run-a", KEY)
    assert not bfloat16.host.adapters and not bfloat16.lora.adapters


def test_snapshot_refusals_write_nothing(original):
    with pytest.raises(NotFound):
        original.snapshot("nope", "nope/snapshots/s")
    original.snapshot("run-a", KEY)
    with pytest.raises(AlreadyExists):
        original.snapshot("run-a", KEY)
    with pytest.raises(InvalidArgument):
        original.snapshot("run-a", "../x")
    assert not [p for p in original.store.root.rglob(".*")]  # no staging folder left behind
    assert not (original.store.root / "nope").exists()


def test_servicer_snapshot_and_restore(original, tiny_model_dir, tmp_path):
    fresh = make_engine(tiny_model_dir, tmp_path, "b")

    async def calls():
        snap = await TrainerServicer(original).SnapshotAdapter(
            trainer_pb2.SnapshotAdapterRequest(training_run_id="run-a", checkpoint_key=KEY), None)
        restored = await TrainerServicer(fresh).RestoreAdapter(
            trainer_pb2.RestoreAdapterRequest(training_run_id="run-a", checkpoint_key=KEY), None)
        with pytest.raises(FailedPrecondition):
            await TrainerServicer(fresh).RestoreAdapter(
                trainer_pb2.RestoreAdapterRequest(training_run_id="run-b", checkpoint_key=KEY), None)
        return snap, restored

    snap, restored = asyncio.run(calls())
    assert (snap.applied_seq_id, snap.steps) == (5, 2) and snap.size_bytes > 0
    assert (restored.applied_seq_id, restored.steps) == (5, 2)
    assert_same_state(state(fresh), state(original))


def test_a_snapshot_finished_after_its_caller_gave_up_is_deleted(original):
    """Issue 21, edge 2: the scheduler gives up a snapshot call (deadline, a frozen trainer's calls
    abandoned, or it died) and never records it; the trainer, busy when the call came, writes it
    later and then deletes it, leaving no unrecorded ``<run>/snapshots/...`` folder behind."""
    import threading

    servicer, key = TrainerServicer(original), "run-a/snapshots/5-late"

    async def scenario():
        loop, busy, behind, hold = asyncio.get_running_loop(), threading.Event(), threading.Event(), threading.Event()
        blocker = loop.run_in_executor(servicer._compute, busy.wait)  # the compute thread is taken
        call = asyncio.ensure_future(servicer.SnapshotAdapter(
            trainer_pb2.SnapshotAdapterRequest(training_run_id="run-a", checkpoint_key=key), None))
        await asyncio.sleep(0.05)
        call.cancel()  # grpc.aio cancels the handler when its caller goes away
        with pytest.raises(asyncio.CancelledError):
            await call
        sentinel = loop.run_in_executor(servicer._compute, lambda: (behind.set(), hold.wait()))  # queued after the snapshot
        busy.set()
        await blocker
        await loop.run_in_executor(None, behind.wait)
        assert original.store.path(key).exists()  # written after all, once the compute thread got to it
        hold.set()
        await sentinel
        for _ in range(200):  # then deleted, on the compute thread
            if not servicer._cleanups and not original.store.path(key).exists():
                break
            await asyncio.sleep(0.05)
        assert not servicer._cleanups

    asyncio.run(scenario())
    assert not original.store.path(key).exists()
    kept = TrainerServicer(original)  # a call that is answered keeps its snapshot
    asyncio.run(kept.SnapshotAdapter(trainer_pb2.SnapshotAdapterRequest(training_run_id="run-a", checkpoint_key=key), None))
    assert original.store.path(key).exists()
