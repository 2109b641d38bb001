"""A trainer group's engine (services/trainer/group.py) in two local processes on gloo, no network
services: rank 0's GroupEngine runs every adapter-changing or computing call on both ranks, in order.

The same script of calls (adapters created with and without a seed, a refused call, co-batched
cycles with optim steps, a checkpoint saved and loaded into another run, a snapshot restored) gives
the losses and adapters of one process (1e-5), and both ranks end with the same adapters."""


import numpy as np
import pytest
import torch

from ranks import free_port, run_ranks
from temper.common.errors import NotFound
from temper.common.validation import DecodedDatum
from temper.services.lora.model import AdapterSpec
from temper.services.trainer.adapters import lora_targets
from temper.services.trainer.engine import AdamParams, ForwardBackwardItem, OptimStepItem

SPECS = {"a": AdapterSpec(rank=4, alpha=8.0, targets=lora_targets(attn=True, mlp=True, unembed=True)),
         "b": AdapterSpec(rank=2, alpha=4.0, targets=lora_targets(attn=True))}
ADAM = AdamParams(learning_rate=1e-2, eps=1e-8)


def cycle(step: int, runs):
    rng = np.random.default_rng(50 + step)
    items = []
    for run_id in runs:
        for _ in range(3):
            tokens = rng.integers(0, 512, int(rng.integers(5, 14)))
            items.append(ForwardBackwardItem(run_id, [DecodedDatum(
                tokens=tokens[:-1].astype(np.int32),
                inputs={"target_tokens": tokens[1:].astype(np.int64), "weights": np.ones(len(tokens) - 1, np.float32)})]))
    return items, [OptimStepItem(run_id, ADAM) for run_id in runs]


def script(engine) -> dict:
    """The calls the scheduler might make; the losses of every cycle."""
    losses = []

    def run(step, runs):
        items, optim = cycle(step, runs)
        results, steps = engine.run_cycle(items, optim)
        assert all(isinstance(s, dict) for s in steps), steps
        losses.append({run_id: [r.metrics["loss:sum"] for r, item in zip(results, items) if item.run_id == run_id]
                       for run_id in runs})

    engine.create_adapter("a", SPECS["a"], 1)
    engine.create_adapter("b", SPECS["b"], None)  # seedless: the group draws one seed for every rank
    with pytest.raises(NotFound):
        engine.drop_adapter("nobody")  # refused alike on every rank: the group goes on
    run(0, ["a", "b"])
    run(1, ["a", "b"])
    engine.save("a", "t/a/ckpt", True)
    engine.create_adapter("c", SPECS["a"], 7)
    engine.load("c", "t/a/ckpt", True)
    engine.snapshot("b", "t/b/snap")
    engine.drop_adapter("b")
    engine.restore("b", "t/b/snap")
    run(2, ["a", "b", "c"])
    return {"losses": losses}


def weights(engine) -> dict:
    return {run_id: {n: p.detach().numpy().copy() for n, p in adapter.params.items()}
            for run_id, adapter in engine.host.adapters.items()}


def settings_for(folder, checkpoints, **group):
    from temper.services.trainer.settings import TrainerSettings
    return TrainerSettings(base_model=str(folder), checkpoint_dir=checkpoints, offload_dir=checkpoints.parent / "offload",
                           num_threads=1, **group)


def rank_main(rank, addr, folder, checkpoints, out, extra):
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist
        from temper.services.models.loading import load_model
        from temper.services.trainer import group

        settings = group.group_settings(settings_for(folder, checkpoints, world_size=2, rank=rank, group_addr=addr,
                                                     group_timeout_seconds=20, **extra))
        joined = group.join(settings)
        engine = group.build_engine(load_model(settings.base_model), settings, joined)
        from temper.services.trainer import numerics
        run_pass, checkpointed = numerics.run_pass, []

        def recording(*args, **kwargs):  # which of this rank's passes ran checkpointed
            checkpointed.append(bool(args[5] if len(args) > 5 else kwargs.get("checkpointed")))
            return run_pass(*args, **kwargs)

        numerics.run_pass = recording
        got = {}
        if rank == 0:
            leader = group.GroupEngine(engine, joined)
            got = script(leader)
            got["world_size"], got["devices"], got["memory"] = leader.world_size, leader.devices, leader.device_memory
            leader.stop()
        else:
            with pytest.raises(SystemExit) as stopped:
                group.follow(engine, joined)
            assert stopped.value.code == 0
        everyone = [None, None]
        dist.all_gather_object(everyone, weights(engine))
        out.put((rank, {**got, "weights": everyone, "checkpointed": checkpointed}))
        dist.destroy_process_group()
    except BaseException:
        import traceback
        out.put((rank, RuntimeError(traceback.format_exc())))
        raise


# the trainer's defaults; and passes of 48 padded tokens or more checkpointed (the decoder layers, FSDP
# units, recomputed in the backward pass, gathering their weights again): one process checkpoints every
# pass of this script, a rank's smaller share only some, and the ranks must agree pass by pass
# and one adapter resident at a time: the others offloaded with their Adam state and brought back
@pytest.mark.parametrize("extra", [{}, {"activation_checkpointing_min_tokens": 48}, {"max_resident_adapters": 1}],
                         ids=["default", "checkpointed", "offloading"])
def test_a_two_rank_group_engine_runs_the_calls_of_one_process(tmp_path, extra):
    from temper.services.models.loading import load_model
    from temper.services.models.tiny import build_tiny_model
    from temper.services.trainer.engine import TrainerEngine

    torch.set_num_threads(1)
    folder = build_tiny_model(tmp_path / "tiny")
    addr = f"127.0.0.1:{free_port()}"
    results = run_ranks(rank_main, lambda r, out: (r, addr, folder, tmp_path / "group" / "ckpt", out, extra), timeout=120)

    alone = TrainerEngine(load_model(str(folder)), settings_for(folder, tmp_path / "alone" / "ckpt", **extra))
    want = script(alone)
    got = results[0]
    assert got["world_size"] == 2 and got["devices"] == ["cpu", "cpu"]
    assert len(got["memory"]) == 2 and all(m > 2**30 for m in got["memory"])  # the host's, by rank
    passes = results[0]["checkpointed"] + results[1]["checkpointed"]
    if "activation_checkpointing_min_tokens" in extra:  # some passes checkpointed, on one rank at least (the other agreed)
        assert any(passes), passes
    else:
        assert not any(passes), passes
    for g, w in zip(got["losses"], want["losses"]):  # the seeded runs as one process trains them
        for run_id in ("a", "c"):
            if run_id in w:
                np.testing.assert_allclose(g[run_id], w[run_id], rtol=1e-5, err_msg=run_id)
    rank0, rank1 = got["weights"]
    assert rank0.keys() == rank1.keys() == {"a", "b", "c"}
    for run_id in rank0:  # replicated: the same on every rank
        for name in rank0[run_id]:
            np.testing.assert_array_equal(rank0[run_id][name], rank1[run_id][name])
    for run_id in ("a", "c"):  # seeded: as one process trains them
        for name, w in weights(alone)[run_id].items():
            np.testing.assert_allclose(rank0[run_id][name], w, atol=1e-5, rtol=0, err_msg=f"{run_id} {name}")
