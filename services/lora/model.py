"""LoraModel: installs MultiLoraLinear layers into a transformers model and manages adapters
(create, drop, state in peft's file format, routing for mixed batches)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from temper.services.lora.layer import LoraWeights, MultiLoraLinear, Router, Routing

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]           # short module names, e.g. ("q_proj", "v_proj")
    dropout: float = 0.0

    def peft_config(self, base_model: str) -> dict:
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": self.rank,
            "lora_alpha": self.alpha, "lora_dropout": self.dropout, "target_modules": sorted(self.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None,
        }

    @classmethod
    def from_peft_config(cls, config: dict) -> "AdapterSpec":
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            raise ValueError("regex target_modules are not supported; list module names")
        return cls(rank=int(config["r"]), alpha=float(config.get("lora_alpha", config["r"])),
                   targets=tuple(sorted(targets)), dropout=float(config.get("lora_dropout", 0.0) or 0.0))


@dataclass
class Adapter:
    key: str
    spec: AdapterSpec
    params: dict[str, nn.Parameter] = field(default_factory=dict)  # peft-format name -> parameter


class LoraModel:
    """Owns the wrapped base model. ``model`` runs like the original model; inside
    ``route(...)`` each row group gets its adapter."""

    def __init__(self, model: nn.Module, base_model_name: str, lora_math_dtype: str = "activation"):
        """``lora_math_dtype``: "activation" runs LoRA matmuls in the activations' dtype (bf16 on a
        bf16 base), "float32" always in float32; adapters and their gradients are float32 either way."""
        if lora_math_dtype not in ("activation", "float32"):
            raise ValueError(f"lora_math_dtype must be 'activation' or 'float32', not {lora_math_dtype!r}")
        self.model = model
        self.base_model_name = base_model_name
        self.router = Router(lora_math_dtype)
        self.layers: dict[str, MultiLoraLinear] = {}   # module path -> wrapper
        self.adapters: dict[str, Adapter] = {}
        for path, module in list(model.named_modules()):
            short = path.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and short in ATTN_MODULES + MLP_MODULES + UNEMBED_MODULES:
                parent_path, _, name = path.rpartition(".")
                wrapper = MultiLoraLinear(module, self.router)
                setattr(model.get_submodule(parent_path) if parent_path else model, name, wrapper)
                self.layers[path] = wrapper
        self.device = next(model.parameters()).device
        self.checkpointing = False  # see checkpoint_decoder_layers

    def available_targets(self) -> set[str]:
        return {p.rsplit(".", 1)[-1] for p in self.layers}

    def add(self, key: str, spec: AdapterSpec, seed: int | None = None) -> Adapter:
        if key in self.adapters:
            raise KeyError(f"adapter {key} exists")
        missing = set(spec.targets) - self.available_targets()
        if missing:
            raise ValueError(f"the base model has no {sorted(missing)} layers to adapt")
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        adapter = Adapter(key, spec)
        for path, layer in self.layers.items():
            if path.rsplit(".", 1)[-1] not in spec.targets:
                continue
            weights = LoraWeights(layer.in_features, layer.out_features, spec.rank, spec.alpha, spec.dropout, self.device, generator)
            layer.adapters[key] = weights
            adapter.params[f"{PEFT_PREFIX}{path}.lora_A.weight"] = weights.lora_A
            adapter.params[f"{PEFT_PREFIX}{path}.lora_B.weight"] = weights.lora_B
        self.adapters[key] = adapter
        return adapter

    def param_shapes(self, spec: AdapterSpec) -> dict[str, tuple[int, int]]:
        """The peft-format names and shapes of the parameters ``add`` would create for ``spec``."""
        shapes = {}
        for path, layer in self.layers.items():
            if path.rsplit(".", 1)[-1] in spec.targets:
                shapes[f"{PEFT_PREFIX}{path}.lora_A.weight"] = (spec.rank, layer.in_features)
                shapes[f"{PEFT_PREFIX}{path}.lora_B.weight"] = (layer.out_features, spec.rank)
        return shapes

    def remove(self, key: str) -> None:
        self.adapters.pop(key)
        for layer in self.layers.values():
            layer.adapters.pop(key, None)

    @contextlib.contextmanager
    def route(self, groups: list[tuple[str | None, torch.Tensor | None]]):
        """Run the model with ``groups``: (adapter key or None for the base model, row indices)."""
        groups = [(k, rows) for k, rows in groups if k is not None]
        with self.router.route(Routing(groups) if groups else None):
            yield

    def stacking(self):
        """A scope of forward and backward passes without weight changes (one trainer call): adapters
        that share batched matmuls use stacked weights built once, and their gradients reach each
        adapter's own parameters when the scope ends (``Router.stacking``)."""
        return self.router.stacking()

    def checkpoint_decoder_layers(self) -> int:
        """Keep only each decoder layer's input during a grad-enabled forward and recompute the
        layer in the backward pass (activation checkpointing): activation memory then grows with
        the hidden size, not with the layers' intermediate tensors. Returns the layer count.

        transformers' own switch works only in train mode, and the trainer runs in eval mode (no
        base-model dropout), so the layers are wrapped here. The routing of the pass is captured
        and set again inside: the backward pass may run on another thread (autograd's device
        threads), where the router's thread-local routing is not set.
        """
        layers = getattr(self.model.get_decoder(), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(self.model).__name__} has no decoder .layers to checkpoint")
        self.checkpointing = True
        for layer in layers:
            layer.forward = self._checkpointed(layer.forward)
        return len(layers)

    @contextlib.contextmanager
    def checkpointing_enabled(self, enabled: bool):
        """Switch the layers wrapped by ``checkpoint_decoder_layers`` on or off for one pass."""
        previous, self.checkpointing = self.checkpointing, enabled
        try:
            yield
        finally:
            self.checkpointing = previous

    def _checkpointed(self, forward):
        def run(*args, **kwargs):
            if not (self.checkpointing and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            routing = self.router.current

            def routed(*a, **k):
                with self.router.route(routing):
                    return forward(*a, **k)

            return checkpoint(routed, *args, use_reentrant=False, **kwargs)

        return run

    # ---- peft file format ---------------------------------------------------------------------

    def state_dict(self, key: str) -> dict[str, torch.Tensor]:
        return {name: p.detach().to("cpu").contiguous() for name, p in self.adapters[key].params.items()}

    def save(self, key: str, folder: Path) -> None:
        adapter = self.adapters[key]
        save_file(self.state_dict(key), str(folder / "adapter_model.safetensors"))
        config = adapter.spec.peft_config(self.base_model_name)
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    @staticmethod
    def read(folder: Path) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
        spec = AdapterSpec.from_peft_config(json.loads((folder / "adapter_config.json").read_text()))
        return spec, load_file(str(folder / "adapter_model.safetensors"))

    def load_weights(self, key: str, weights: dict[str, torch.Tensor]) -> None:
        """Copy peft-format weights into adapter ``key`` (names and shapes must match exactly)."""
        params = self.adapters[key].params
        if set(weights) != set(params):
            extra, missing = sorted(set(weights) - set(params)), sorted(set(params) - set(weights))
            raise ValueError(f"weights do not match adapter {key}: unexpected {extra[:3]}, missing {missing[:3]}")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
