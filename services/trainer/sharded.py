"""Model sharding on torch.distributed (issue 20): the frozen base model's weights spread over N
ranks, LoRA adapters replicated, a cycle's rows split over the ranks (data parallel).

* Base weights. Every decoder layer is an FSDP2 unit (``torch.distributed.fsdp.fully_shard`` over a
  1-D DeviceMesh) and the decoder is the root unit (final norm): a layer's weights are all-gathered
  just before it runs, freed after, and gathered again for its backward pass. The embedding and the
  output head (the same tensor when tied) are not FSDP units: ``numerics`` calls the head once per
  logprob chunk, and the chunk count differs between ranks, so a per-call all-gather there would
  leave the ranks' collectives out of step. They are sharded by hand (``OuterParams``: each rank keeps
  1/N of the flattened tensor) and gathered once per pass, freed after the pass's backward.
* Adapters. ``LoraModel`` keeps adapters in plain dicts (``MultiLoraLinear.adapters``,
  ``MultiLoraExperts.adapters``), so they are not submodules of the wrapped model and
  ``fully_shard`` never sees them: they stay ordinary float32 tensors, and so does their AdamW state.
* Rows. ``forward_backward`` gives each rank a token-balanced share of the rows, runs the same
  number of passes on every rank (a short dummy pass where a rank has run out of rows: FSDP's
  all-gathers are collectives), all-reduces (sum) the LoRA gradients, the loss sums and statistics,
  and all-gathers the per-datum logprobs and losses: every rank gets what one process would, so every
  rank's AdamW step is the same and the adapters stay identical.

The embedding's output is made to require grad in grad-enabled passes, so that every pass's
backward runs through every layer on every rank (otherwise a rank whose rows' adapters only touch
the head would skip the layers' backward all-gathers the other rank waits in).
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from temper.services.lora.model import LoraModel
from temper.services.trainer import numerics
from temper.services.trainer.logprob_pass import target_logprobs_pass
from temper.services.trainer.numerics import ForwardBackwardResult, LossGroup, PassOptions, Row


class GroupJoinTimeout(RuntimeError):
    """Not every rank joined the process group in time."""


def init_group(rank: int, world: int, init_method: str, timeout: datetime.timedelta | float = 30.0,
               backend: str = "gloo") -> dist.ProcessGroup:
    """Join the default process group (``init_method`` e.g. ``tcp://127.0.0.1:29500``). A rank that
    never joins does not hang the others: after ``timeout`` they raise GroupJoinTimeout."""
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    start = time.monotonic()
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        # gloo connects lazily on some versions: one collective proves every rank is there
        dist.barrier()
    except Exception as exc:  # DistStoreError, RuntimeError (gloo), TimeoutError: all mean "not joined"
        if dist.is_initialized():
            dist.destroy_process_group()
        waiting = (f"rank 0 waited for rank{'s' if world > 2 else ''} {', '.join(map(str, range(1, world)))}"
                   if rank == 0 else f"rank {rank} waited for rank 0's rendezvous and the other ranks")
        raise GroupJoinTimeout(f"rank {rank}/{world}: the process group at {init_method} did not form within "
                               f"{timeout.total_seconds():g}s ({time.monotonic() - start:.1f}s waited; {waiting}; "
                               f"a rank that never joins: is it started, with the same group address?): "
                               f"{type(exc).__name__}: {exc}") from exc
    return dist.group.WORLD


def make_mesh(world: int | None = None, device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (world or dist.get_world_size(),), mesh_dim_names=("shard",))


# ---- base weights -----------------------------------------------------------------------------


class OuterParams:
    """The embedding and head weights, sharded by hand: each rank keeps one 1/N slice of every
    flattened tensor; ``gather`` puts the full tensors back for a pass, ``release`` frees them."""

    def __init__(self, params: list[nn.Parameter], group=None):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = params
        self.shapes = [p.shape for p in params]
        self.shards: list[torch.Tensor] = []
        self.gathered = False
        for p in params:
            flat = p.detach().reshape(-1)
            size = -(-flat.numel() // self.world)
            padded = torch.zeros(size * self.world, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            self.shards.append(padded[self.rank * size:(self.rank + 1) * size].clone())
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def gather(self) -> None:
        if self.gathered:
            return
        for p, shard, shape in zip(self.params, self.shards, self.shapes):
            full = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=shard.device)
            _all_gather(full, shard, self.group)
            p.data = full[: shape.numel()].view(shape)
        self.gathered = True

    def release(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.gathered = False

    def local_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12+
    gather(output, shard, group=group)


@dataclass
class ShardedModel:
    lora: LoraModel
    mesh: object
    outer: OuterParams
    hook: object = field(default=None, repr=False)

    @property
    def group(self):
        return self.mesh.get_group()


def shard_base_model(lora_or_model: LoraModel | nn.Module, mesh) -> ShardedModel | nn.Module:
    """Shard the base model's weights over ``mesh`` (1-D): each decoder layer an FSDP2 unit, the
    decoder the root unit, embedding + head sharded by hand (``OuterParams``). Build the LoraModel
    first (it wraps the linear layers and reads the experts' shapes); adapters may be added before
    or after. Given a LoraModel, returns the ShardedModel ``forward_backward`` takes."""
    from torch.distributed.fsdp import fully_shard

    lora = lora_or_model if isinstance(lora_or_model, LoraModel) else None
    model = lora.model if lora is not None else lora_or_model
    decoder = model.get_decoder()
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    outer = list({id(p): p for p in [embed.weight, getattr(head, "weight", None)] if p is not None}.values())
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True, ignored_params=set(outer))
    outer_params = OuterParams(outer, mesh.get_group())

    def require_grad(_module, _inputs, output):
        # every grad-enabled pass runs its backward through every layer on every rank (see module doc)
        if torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_()
        return output

    handle = embed.register_forward_hook(require_grad)
    if lora is None:
        return model
    return ShardedModel(lora, mesh, outer_params, handle)


def base_weight_bytes(model: nn.Module, outer: OuterParams | None = None) -> int:
    """Bytes of base-model weights this rank holds (its shards, when sharded), buffers excluded."""
    from torch.distributed.tensor import DTensor
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total + (outer.local_bytes() if outer is not None else 0)


# ---- rows over ranks ------------------------------------------------------------------------------


def split_rows(rows: list[Row], world: int) -> list[list[Row]]:
    """Token-balanced shares of ``rows`` (longest first to the least loaded rank; same on every rank)."""
    shares: list[list[Row]] = [[] for _ in range(world)]
    load = [0] * world
    for n in sorted(range(len(rows)), key=lambda n: -len(rows[n].datum.tokens)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(n)
        load[r] += len(rows[n].datum.tokens)
    return [[rows[n] for n in sorted(share)] for share in shares]


def sharded_not_deterministic(world_size: int) -> str:
    """Why a trainer group's ranks cannot run a deterministic item."""
    return (f"a sharded trainer group ({world_size} ranks) has no batch-invariant kernels: its passes split rows "
            f"over the ranks, gather FSDP-sharded layers and sum gradients across them (sharded.forward_backward); "
            f"deterministic runs need a single-process trainer")


def sharded_no_images(world_size: int) -> str:
    """Why a trainer group's ranks refuse images (their passes run the decoder alone, sharded)."""
    return (f"a sharded trainer group ({world_size} ranks) does not take images: its FSDP-sharded passes run the "
            f"language model's decoder alone, without the vision tower; image datums need a single-process trainer")


def forward_backward(sharded: ShardedModel, groups: list[LossGroup], options: PassOptions, device: torch.device,
                     comm: dict | None = None) -> list[ForwardBackwardResult]:
    """``numerics.forward_backward`` over the ranks: this rank's share of the rows, LoRA gradients and
    loss metrics summed over the ranks, logprobs and losses of every datum on every rank. Every rank
    calls it with the same ``groups``. ``comm`` (optional) gets the bytes this rank sent per kind."""
    lora, group = sharded.lora, sharded.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if any(g.deterministic for g in groups):  # the engine refuses them first (TrainerEngine.deterministic_unsupported)
        from temper.common.errors import FailedPrecondition  # grpc: not at import (numerics' lean-import rule)
        raise FailedPrecondition(sharded_not_deterministic(world))  # the same on every rank, before any collective
    comm = comm if comm is not None else {}
    logprobs = [[None] * len(g.data) for g in groups]
    losses = [[None] * len(g.data) for g in groups]
    stat_sums: list[dict[str, list[float]]] = [defaultdict(lambda: [0.0, 0.0]) for _ in groups]
    adapter_rank = {key: n for n, key in enumerate(dict.fromkeys(g.adapter for g in groups))}
    trained = [p for key in dict.fromkeys(g.adapter for g in groups if not g.forward_only)
               for _, p in sorted(lora.adapters[key].params.items())]
    earlier = [p.grad for p in trained]  # gradients accumulated before this call: only this call's are summed
    for p in trained:
        p.grad = None
    mine: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    try:
        with lora.stacking():
            for grad in (True, False):
                rows = [Row(i, j, d) for i, g in enumerate(groups) if g.forward_only != grad for j, d in enumerate(g.data)]
                local = split_rows(rows, world)[rank]
                local.sort(key=lambda row: adapter_rank[groups[row.group].adapter])
                plan = _agreed(list(numerics.plan_passes(local, options, grad)), group)
                for batch, checkpointed in plan:
                    sharded.outer.gather()
                    try:
                        with torch.set_grad_enabled(grad):
                            if batch is None:
                                _dummy_pass(lora, options, device, grad, checkpointed)
                                continue
                            lp, elementwise, stats = numerics.run_pass(lora, groups, batch, options, device, checkpointed)
                            if grad:
                                elementwise.sum().backward()
                    finally:
                        sharded.outer.release()
                    for r, row in enumerate(batch):
                        n, shape = len(row.datum.tokens), row.datum.inputs["target_tokens"].shape
                        cols = numerics.columns(row.datum.inputs["target_tokens"])
                        mine[(row.group, row.index)] = (
                            lp[r, :n, :cols].detach().float().cpu().numpy().reshape(shape),
                            elementwise[r, :n, :cols].detach().float().cpu().numpy().reshape(shape))
                    for i, group_stats in stats.items():
                        for name, (total, cnt) in group_stats.items():
                            stat_sums[i][name][0] += total
                            stat_sums[i][name][1] += cnt
        _sum_gradients(trained, group, comm)
    finally:
        for p, before in zip(trained, earlier):
            if before is not None:
                p.grad = before if p.grad is None else before.add_(p.grad)
    # every datum's logprobs and losses on every rank
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    comm["results"] = comm.get("results", 0) + sum(a.nbytes + b.nbytes for a, b in mine.values())
    for share in everyone:
        for (i, j), (lp, loss) in share.items():
            logprobs[i][j], losses[i][j] = lp, loss
    # statistics: (sum, count) per group and name, summed over ranks (names sorted: same order everywhere)
    names = sorted({(i, name) for i in range(len(groups)) for name in stat_sums[i]})
    names_everywhere: list = [None] * world
    dist.all_gather_object(names_everywhere, names, group=group)
    names = sorted(set().union(*map(set, names_everywhere)))
    if names:
        flat = torch.tensor([stat_sums[i][name][c] for i, name in names for c in (0, 1)], dtype=torch.float64)
        dist.all_reduce(flat, group=group)
        comm["metrics"] = comm.get("metrics", 0) + flat.numel() * flat.element_size()
        for n, (i, name) in enumerate(names):
            stat_sums[i][name] = [float(flat[2 * n]), float(flat[2 * n + 1])]
    results = []
    for i, g in enumerate(groups):
        total = sum(float(loss.sum(dtype=np.float64)) for loss in losses[i])
        metrics = numerics.summed_metrics(g, total)
        metrics.update({f"{name}:mean": t / max(c, 1.0) for name, (t, c) in stat_sums[i].items()})
        results.append(ForwardBackwardResult(logprobs[i], losses[i], metrics))
    return results


def _agreed(plan: list, group) -> list:
    """This rank's passes, as many as the rank with the most (``(None, checkpointed)`` for a pass it has
    no rows for), each checkpointed if any rank checkpoints its pass of that number: a checkpointed
    layer gathers its weights again when it is recomputed, so every rank must do the same, pass by pass."""
    count = torch.tensor([len(plan)], dtype=torch.long)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    flags = torch.zeros(int(count), dtype=torch.long)
    flags[:len(plan)] = torch.tensor([int(bool(checkpointed)) for _, checkpointed in plan], dtype=torch.long)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    batches = [batch for batch, _ in plan] + [None] * (int(count) - len(plan))
    return [(batch, bool(flag)) for batch, flag in zip(batches, flags.tolist())]


def _dummy_pass(lora: LoraModel, options: PassOptions, device: torch.device, grad: bool, checkpointed: bool) -> None:
    """One token through the base model (no adapter), backward included: the collectives of a pass
    on a rank that has no rows left (checkpointed like the other ranks' pass of that number)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    mask = torch.ones(1, 1, dtype=torch.bool, device=device)
    targets = torch.zeros(1, 1, 1, dtype=torch.long, device=device)
    lp = target_logprobs_pass(lora, ids, mask, targets, [], options.logprob_chunk_tokens, checkpointed)
    if grad:
        (lp.sum() * 0.0).backward()


def _sum_gradients(params: list[nn.Parameter], group, comm: dict) -> None:
    """Sum every trained LoRA parameter's gradient over the ranks (one flat all-reduce)."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    comm["lora_grads"] = comm.get("lora_grads", 0) + flat.numel() * flat.element_size()
    at = 0
    for p in params:
        n = p.numel()
        p.grad = flat[at:at + n].view_as(p).clone()
        at += n


class CommCounter:
    """Bytes this rank sends, FSDP's all-gathers included: wraps the c10d tensor collectives (FSDP2
    calls them through ``torch.distributed``'s module attributes) and counts what a ring algorithm
    sends: (N-1)/N of a gathered tensor, 2 (N-1)/N of an all-reduced one. ``all_gather_object``
    (results, a few KiB) is counted by ``forward_backward``'s ``comm``, not here."""

    def __init__(self):
        self.bytes = defaultdict(int)
        self.seconds = defaultdict(float)  # wall time inside each kind of collective (waits included)
        self._saved = {}

    def __enter__(self):
        world = dist.get_world_size()
        names = ["all_gather_single", "all_gather_into_tensor", "all_reduce", "reduce_scatter_single",
                 "reduce_scatter_tensor"]
        for name in names:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                tensor = args[0] if args else next(iter(kwargs.values()))
                if isinstance(tensor, (list, tuple)):
                    tensor = tensor[0] if tensor else None
                if isinstance(tensor, torch.Tensor):
                    if _name == "all_reduce":  # ring all-reduce: 2 (N-1)/N of the tensor
                        self.bytes[_name] += int(2 * (world - 1) / world * tensor.numel() * tensor.element_size())
                    else:
                        self.bytes[_name] += int((world - 1) / world * tensor.numel() * tensor.element_size())
                start = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds[_name] += time.perf_counter() - start

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
