"""LoRA adapters on one shared base model: creation, parameters, optimizer state, save and load.

Adapters live in one peft model under short internal names ("a0", "a1", ...) because run ids
contain characters peft uses in paths. Weights are saved in peft's own format so
``PeftModel.from_pretrained`` (and the sampler) load them unchanged.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from temper.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from temper.v1 import types_pb2

ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
UNEMBED_MODULES = ["lm_head"]
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"


def target_modules(cfg: types_pb2.LoraConfig) -> list[str]:
    modules = (ATTN_MODULES if cfg.train_attn else []) + (MLP_MODULES if cfg.train_mlp else [])
    modules += UNEMBED_MODULES if cfg.train_unembed else []
    if not modules:
        raise InvalidArgument("LoRA config trains nothing: enable train_attn, train_mlp or train_unembed")
    return modules


@dataclass
class Adapter:
    adapter_id: str
    peft_name: str
    config: types_pb2.LoraConfig
    params: dict[str, torch.nn.Parameter]          # internal param name -> parameter
    optimizer: torch.optim.AdamW
    steps: int = 0
    pending_tokens: int = 0                          # tokens accumulated into gradients since the last step
    meta: dict = field(default_factory=dict)

    def grads_snapshot(self) -> dict[str, torch.Tensor | None]:
        return {n: (p.grad.clone() if p.grad is not None else None) for n, p in self.params.items()}

    def restore_grads(self, snapshot: dict[str, torch.Tensor | None]) -> None:
        for n, p in self.params.items():
            p.grad = snapshot[n]


class AdapterHost:
    """Owns the peft-wrapped base model and every adapter on it."""

    def __init__(self, base_model: torch.nn.Module, base_model_name: str, default_alpha: float):
        self.base = base_model
        self.base_model_name = base_model_name
        self.default_alpha = default_alpha
        self.model: PeftModel | None = None
        self.adapters: dict[str, Adapter] = {}
        self._names = (f"a{i}" for i in itertools.count())

    def get(self, adapter_id: str) -> Adapter:
        try:
            return self.adapters[adapter_id]
        except KeyError:
            raise NotFound(f"adapter {adapter_id} is not loaded on this trainer") from None

    def peft_config(self, cfg: types_pb2.LoraConfig) -> PeftLoraConfig:
        if cfg.rank <= 0:
            raise InvalidArgument(f"LoRA rank must be positive, got {cfg.rank}")
        if not 0.0 <= cfg.dropout < 1.0:
            raise InvalidArgument(f"LoRA dropout must be in [0, 1), got {cfg.dropout}")
        return PeftLoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha or self.default_alpha,
            lora_dropout=cfg.dropout,
            target_modules=target_modules(cfg),
            base_model_name_or_path=self.base_model_name,
        )

    def create(self, adapter_id: str, cfg: types_pb2.LoraConfig) -> Adapter:
        if adapter_id in self.adapters:
            raise AlreadyExists(f"adapter {adapter_id} already exists")
        peft_cfg = self.peft_config(cfg)
        name = next(self._names)
        with torch.random.fork_rng():
            if cfg.HasField("seed"):
                torch.manual_seed(cfg.seed)
            if self.model is None:
                self.model = get_peft_model(self.base, peft_cfg, adapter_name=name)
            else:
                self.model.add_adapter(name, peft_cfg)
        self.model.eval()
        marker = f".{name}."
        params = {}
        for pname, param in self.model.named_parameters():
            if marker in pname:
                param.requires_grad_(True)
                params[pname.replace(marker, ".")] = param
        # Adam settings are overwritten on every step from the request's AdamParams.
        optimizer = torch.optim.AdamW(list(params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        adapter = Adapter(adapter_id=adapter_id, peft_name=name, config=cfg, params=params, optimizer=optimizer)
        self.adapters[adapter_id] = adapter
        return adapter

    def drop(self, adapter_id: str) -> None:
        adapter = self.get(adapter_id)
        self.model.delete_adapter(adapter.peft_name)
        del self.adapters[adapter_id]

    def activate(self, adapter: Adapter) -> PeftModel:
        """Make ``adapter`` the one the next forward pass uses."""
        self.model.set_adapter(adapter.peft_name)
        # peft's set_adapter leaves only the active adapter trainable; that is what we want, since
        # gradients must land in the adapter whose rows are in the batch.
        dropout = adapter.config.dropout > 0
        self.model.train(dropout)
        return self.model

    # ---- persistence -------------------------------------------------------------------------

    def save(self, adapter: Adapter, folder: Path, include_optimizer: bool) -> None:
        state = get_peft_model_state_dict(self.model, adapter_name=adapter.peft_name, save_embedding_layers=False)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))
        config = self.model.peft_config[adapter.peft_name].to_dict()
        config["target_modules"] = sorted(config["target_modules"])
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        if include_optimizer:
            self._save_optimizer(adapter, folder)

    def _save_optimizer(self, adapter: Adapter, folder: Path) -> None:
        tensors, steps = {}, {}
        for name, param in adapter.params.items():
            st = adapter.optimizer.state.get(param)
            if not st:
                continue
            tensors[f"exp_avg/{name}"] = st["exp_avg"].contiguous()
            tensors[f"exp_avg_sq/{name}"] = st["exp_avg_sq"].contiguous()
            steps[name] = float(st["step"])
        save_file(tensors, str(folder / OPTIMIZER_FILE))
        (folder / OPTIMIZER_META).write_text(json.dumps({"steps": adapter.steps, "param_steps": steps}, indent=2))

    def check_compatible(self, adapter: Adapter, folder: Path, with_optimizer: bool) -> dict[str, torch.Tensor]:
        """Read a checkpoint and check it fits ``adapter``; returns its weights. Touches nothing."""
        config = json.loads((folder / "adapter_config.json").read_text())
        want = self.model.peft_config[adapter.peft_name]
        if int(config.get("r", -1)) != want.r or sorted(config.get("target_modules") or []) != sorted(want.target_modules):
            raise FailedPrecondition(
                f"checkpoint LoRA config (rank {config.get('r')}, targets {config.get('target_modules')}) does not match "
                f"run {adapter.adapter_id} (rank {want.r}, targets {sorted(want.target_modules)})"
            )
        if with_optimizer and not (folder / OPTIMIZER_FILE).is_file():
            raise FailedPrecondition("checkpoint has no optimizer state; save it as a training checkpoint")
        return load_file(str(folder / "adapter_model.safetensors"))

    def load(self, adapter: Adapter, folder: Path, weights: dict[str, torch.Tensor], with_optimizer: bool) -> None:
        result = set_peft_model_state_dict(self.model, weights, adapter_name=adapter.peft_name)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise FailedPrecondition(f"checkpoint has unexpected keys, e.g. {unexpected[:3]}")
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
                        "exp_avg": tensors[f"exp_avg/{name}"].clone(),
                        "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].clone(),
                    }
            adapter.steps = int(meta["steps"])
