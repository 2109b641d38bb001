"""Training state of every run's adapter on the trainer: LoRA weights (in the shared LoraModel,
keyed by the run id), one AdamW per adapter, accumulated gradients, and checkpoint files in peft's
format."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_bytes

from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from temper.services.lora.model import ATTN_MODULES, MLP_MODULES, UNEMBED_MODULES, AdapterSpec, LoraModel

OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"


def lora_targets(attn: bool = False, mlp: bool = False, unembed: bool = False) -> tuple[str, ...]:
    """The module names an adapter trains, sorted (the order AdapterSpec and peft files use)."""
    targets = (ATTN_MODULES if attn else ()) + (MLP_MODULES if mlp else ()) + (UNEMBED_MODULES if unembed else ())
    return tuple(sorted(targets))


@dataclass
class OffloadedState:
    """An adapter's training state as flat CPU tensors, outside the model: an evicted adapter kept in
    host memory (the offload file holds the same), and what a snapshot holds (``snapshots.py``).

    ``tensors``: ``weight/<name>``, ``grad/<name>`` (only for a parameter whose grad is not None: a
    None and a zero gradient stay apart), and for a parameter Adam has stepped ``exp_avg/<name>``,
    ``exp_avg_sq/<name>`` and ``step/<name>`` (the 0-d step tensor as Adam keeps it). ``group``: the
    optimizer's hyperparameters (its one param group without the params, JSON-able)."""
    tensors: dict[str, torch.Tensor]
    group: dict


def new_optimizer(params: dict[str, torch.nn.Parameter], group: dict | None = None) -> torch.optim.AdamW:
    """One adapter's AdamW. lr, betas, eps and weight decay are overwritten on every step from the
    request's AdamParams; ``group`` sets the hyperparameters of an adapter brought back (keys this
    torch's AdamW does not know are ignored)."""
    optimizer = torch.optim.AdamW(list(params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    if group:
        (current,) = optimizer.param_groups
        current.update({k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k in current and k != "params"})
    return optimizer


def optimizer_group(optimizer: torch.optim.Optimizer) -> dict:
    """The hyperparameters of the adapter optimizer's one param group, JSON-able (betas as a list)."""
    (group,) = optimizer.param_groups
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


@dataclass
class TrainedAdapter:
    run_id: str
    spec: AdapterSpec
    params: dict[str, torch.nn.Parameter]   # peft-format name -> parameter
    optimizer: torch.optim.AdamW
    steps: int = 0
    pending_tokens: int = 0                 # tokens accumulated into gradients since the last step
    offloaded: Path | OffloadedState | None = None  # set while evicted: weights, grads and Adam state (file or host memory)
    last_used: int = field(default=0, compare=False)
    # The highest run seq applied to this adapter, and the answers of the latest ones: a cycle re-sent
    # after a scheduler restart is answered from here instead of being applied twice.
    applied_seq: int = 0
    answers: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)

    def remember(self, seq_id: int, answer, keep: int) -> None:
        self.applied_seq = max(self.applied_seq, seq_id)
        self.answers[seq_id] = answer
        while len(self.answers) > keep:
            self.answers.popitem(last=False)

    def grads_snapshot(self) -> dict[str, torch.Tensor | None]:
        return {n: (p.grad.clone() if p.grad is not None else None) for n, p in self.params.items()}

    def restore_grads(self, snapshot: dict[str, torch.Tensor | None]) -> None:
        for n, p in self.params.items():
            p.grad = snapshot[n]


class AdapterHost:
    """Every adapter of the trainer. At most ``max_resident`` live in the model; past that the least
    recently used adapter outside the current cycle is offloaded, with its gradients and optimizer
    state, to host memory (``offload_to="host"``; pinned when the model is on a GPU) or to a file in
    ``offload_dir`` (``"disk"``), and brought back exactly when next used."""

    def __init__(self, lora: LoraModel, max_resident: int = 0, offload_dir: Path | None = None, offload_to: str = "disk"):
        if offload_to not in ("disk", "host"):
            raise ValueError(f"offload_to must be 'disk' or 'host', got {offload_to!r}")
        self.lora = lora
        self.max_resident = max_resident            # 0: no limit
        self.offload_dir = Path(offload_dir) if offload_dir else None
        self.offload_to = offload_to
        self.adapters: dict[str, TrainedAdapter] = {}
        self._clock = itertools.count(1)
        self._pinned: set[str] = set()

    def get(self, run_id: str) -> TrainedAdapter:
        """The adapter, resident in the model (restored from offload if needed)."""
        try:
            adapter = self.adapters[run_id]
        except KeyError:
            raise NotFound(f"the adapter of run {run_id} is not loaded on this trainer") from None
        adapter.last_used = next(self._clock)
        if adapter.offloaded is not None:
            self._restore(adapter)
        self._evict_over_capacity(keep=run_id)
        return adapter

    @contextlib.contextmanager
    def pinned(self, run_ids):
        """Adapters of the cycle in progress: never evicted while it runs."""
        previous, self._pinned = self._pinned, set(run_ids)
        try:
            yield
        finally:
            self._pinned = previous

    def resident(self) -> list[str]:
        return [k for k, a in self.adapters.items() if a.offloaded is None]

    def _evict_over_capacity(self, keep: str) -> None:
        if not self.max_resident or (self.offload_to == "disk" and self.offload_dir is None):
            return
        resident = [a for a in self.adapters.values() if a.offloaded is None]
        candidates = sorted((a for a in resident if a.run_id != keep and a.run_id not in self._pinned), key=lambda a: a.last_used)
        for adapter in candidates[: max(0, len(resident) - self.max_resident)]:
            self._offload(adapter)

    def _offload(self, adapter: TrainedAdapter) -> None:
        on_gpu = any(p.is_cuda for p in adapter.params.values())

        def to_host(t: torch.Tensor) -> torch.Tensor:
            # a copy, never a view of the live tensor (on CPU .cpu() would return the tensor itself)
            host = t.detach().to("cpu", copy=True).contiguous()
            return host.pin_memory() if on_gpu and self.offload_to == "host" else host

        state = self._flat_state(adapter, to_host)
        if self.offload_to == "host":
            offloaded = state
        else:
            self.offload_dir.mkdir(parents=True, exist_ok=True)
            offloaded = self.offload_dir / (re.sub(r"[^A-Za-z0-9._-]", "_", adapter.run_id) + ".safetensors")
            save_file(state.tensors, str(offloaded), metadata={"optimizer_group": json.dumps(state.group)})
        self.lora.remove(adapter.run_id)
        adapter.params, adapter.optimizer, adapter.offloaded = {}, None, offloaded

    @staticmethod
    def _flat_state(adapter: TrainedAdapter, to_host) -> OffloadedState:
        tensors = {}
        for name, param in adapter.params.items():
            tensors[f"weight/{name}"] = to_host(param)
            if param.grad is not None:
                tensors[f"grad/{name}"] = to_host(param.grad)
            state = adapter.optimizer.state.get(param)
            if state:
                for kind in ("exp_avg", "exp_avg_sq", "step"):
                    tensors[f"{kind}/{name}"] = to_host(state[kind])
        return OffloadedState(tensors, optimizer_group(adapter.optimizer))

    @staticmethod
    def _offloaded_state(adapter: TrainedAdapter) -> OffloadedState:
        if isinstance(adapter.offloaded, OffloadedState):
            return adapter.offloaded
        from safetensors import safe_open

        with safe_open(str(adapter.offloaded), "pt") as f:
            group = json.loads(f.metadata()["optimizer_group"])
        return OffloadedState(load_file(str(adapter.offloaded)), group)

    def state_of(self, run_id: str) -> tuple[TrainedAdapter, OffloadedState]:
        """The adapter and its whole training state as CPU tensors (copies; an offloaded adapter's as
        offloaded, not to be changed), leaving where it lives as it is: resident or offloaded."""
        adapter = self.adapters.get(run_id)
        if adapter is None:
            raise NotFound(f"the adapter of run {run_id} is not loaded on this trainer")
        if adapter.offloaded is not None:
            return adapter, self._offloaded_state(adapter)
        return adapter, self._flat_state(adapter, lambda t: t.detach().to("cpu", copy=True).contiguous())

    def _build(self, run_id: str, spec: AdapterSpec, state: OffloadedState) -> tuple[dict, torch.optim.AdamW]:
        """Adapter ``run_id`` added to the model with ``state`` (its tensors are taken over, not copied
        where already on the device); on failure nothing of it stays in the model."""
        params = self.lora.add(run_id, spec, seed=0).params
        try:
            tensors = state.tensors
            self.lora.load_weights(run_id, {n: tensors[f"weight/{n}"] for n in params})
            optimizer = new_optimizer(params, state.group)
            (group,) = optimizer.param_groups
            step_on_device = bool(group.get("capturable") or group.get("fused"))  # else Adam keeps steps on the CPU
            for name, param in params.items():
                if f"grad/{name}" in tensors:
                    param.grad = tensors[f"grad/{name}"].to(param.device)
                if f"step/{name}" in tensors:
                    step = tensors[f"step/{name}"]
                    optimizer.state[param] = {
                        "step": step.to(param.device) if step_on_device else step,
                        "exp_avg": tensors[f"exp_avg/{name}"].to(param.device),
                        "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(param.device),
                    }
        except BaseException:
            self.lora.remove(run_id)
            raise
        return params, optimizer

    def _restore(self, adapter: TrainedAdapter) -> None:
        adapter.params, adapter.optimizer = self._build(adapter.run_id, adapter.spec, self._offloaded_state(adapter))
        if isinstance(adapter.offloaded, Path):
            adapter.offloaded.unlink()
        adapter.offloaded = None

    def replace(self, run_id: str, spec: AdapterSpec, state: OffloadedState) -> TrainedAdapter:
        """A new adapter for ``run_id`` from ``state`` (checked to fit this model: ``snapshots.read``), in
        place of the run's adapter if it has one. Should building fail, the run has no adapter here:
        never a mix of the old and the new. Steps, seqs and answers are the caller's to set."""
        if run_id in self.adapters:
            self.drop(run_id)
        params, optimizer = self._build(run_id, spec, state)
        adapter = TrainedAdapter(run_id, spec, params, optimizer, last_used=next(self._clock))
        self.adapters[run_id] = adapter
        self._evict_over_capacity(keep=run_id)
        return adapter

    def create(self, run_id: str, spec: AdapterSpec, seed: int | None = None) -> TrainedAdapter:
        if run_id in self.adapters:
            raise AlreadyExists(f"run {run_id} already has an adapter on this trainer")
        if spec.rank <= 0 or not 0.0 <= spec.dropout < 1.0 or not spec.targets:
            raise InvalidArgument(f"bad LoRA spec {spec}: rank must be positive, dropout in [0, 1), targets not empty")
        try:
            lora_adapter = self.lora.add(run_id, spec, seed=seed)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        params = lora_adapter.params
        adapter = TrainedAdapter(run_id, lora_adapter.spec, params, new_optimizer(params), last_used=next(self._clock))
        self.adapters[run_id] = adapter
        self._evict_over_capacity(keep=run_id)
        return adapter

    def drop(self, run_id: str) -> None:
        adapter = self.adapters.get(run_id)
        if adapter is None:
            raise NotFound(f"the adapter of run {run_id} is not loaded on this trainer")
        if isinstance(adapter.offloaded, Path):
            adapter.offloaded.unlink(missing_ok=True)
        elif adapter.offloaded is None:
            self.lora.remove(run_id)
        del self.adapters[run_id]

    # ---- persistence -------------------------------------------------------------------------

    def checkpoint_files(self, adapter: TrainedAdapter, include_optimizer: bool) -> dict[str, bytes]:
        """What a save of ``adapter`` writes, file name -> bytes: its size is known before anything is
        written (max_storage_bytes is checked against it)."""
        files = self.lora.files(adapter.run_id)
        if include_optimizer:
            tensors, steps = {}, {}
            for name, param in adapter.params.items():
                state = adapter.optimizer.state.get(param)
                if state:
                    tensors[f"exp_avg/{name}"] = state["exp_avg"].detach().cpu().contiguous()
                    tensors[f"exp_avg_sq/{name}"] = state["exp_avg_sq"].detach().cpu().contiguous()
                    steps[name] = float(state["step"])
            files[OPTIMIZER_FILE] = safetensors_bytes(tensors)
            files[OPTIMIZER_META] = json.dumps({"steps": adapter.steps, "param_steps": steps}, indent=2).encode()
        return files

    def read_checkpoint(self, adapter: TrainedAdapter, folder: Path, with_optimizer: bool) -> dict[str, torch.Tensor]:
        """Read a checkpoint and check it fits ``adapter``; returns its weights. Touches nothing."""
        spec, weights = LoraModel.read(folder)
        if (spec.rank, spec.targets, spec.expert_rank) != (adapter.spec.rank, adapter.spec.targets, adapter.spec.expert_rank):
            experts = lambda s: f", expert rank {s.expert_rank}" if s.expert_targets else ""  # noqa: E731
            raise FailedPrecondition(
                f"checkpoint LoRA config (rank {spec.rank}{experts(spec)}, targets {list(spec.targets)}) does not match run "
                f"{adapter.run_id} (rank {adapter.spec.rank}{experts(adapter.spec)}, targets {list(adapter.spec.targets)})"
            )
        if set(weights) != set(adapter.params):
            raise FailedPrecondition("checkpoint weights do not match the run's adapter layout")
        if with_optimizer and not (folder / OPTIMIZER_FILE).is_file():
            raise FailedPrecondition("checkpoint has no optimizer state; save it as a training checkpoint")
        return weights

    def load(self, adapter: TrainedAdapter, folder: Path, weights: dict[str, torch.Tensor], with_optimizer: bool) -> None:
        self.lora.load_weights(adapter.run_id, weights)
        for param in adapter.params.values():
            param.grad = None
        adapter.optimizer.state.clear()
        adapter.pending_tokens = 0
        if with_optimizer:
            tensors = load_file(str(folder / OPTIMIZER_FILE))
            meta = json.loads((folder / OPTIMIZER_META).read_text())
            for name, param in adapter.params.items():
                if f"exp_avg/{name}" in tensors:
                    adapter.optimizer.state[param] = {
                        "step": torch.tensor(meta["param_steps"][name]),
                        "exp_avg": tensors[f"exp_avg/{name}"].to(param.device).clone(),
                        "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(param.device).clone(),
                    }
            adapter.steps = int(meta["steps"])
