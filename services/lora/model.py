"""LoraModel: installs MultiLoraLinear layers (and MultiLoraExperts on a mixture-of-experts family's
routed experts) into a transformers model and manages adapters (create, drop, state in peft's file
format, routing for mixed batches). What a model's layers are called comes from its family
(``services/models/families.py``); a model of no known family takes no adapter."""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.utils.checkpoint import checkpoint

from temper.services.lora.expert_rank import resolve_expert_rank
from temper.services.lora.experts import MultiLoraExperts
from temper.services.lora.layer import LoraWeights, MultiLoraLinear, Router, Routing
from temper.services.models import families
from temper.services.models.families import ATTN_LINEARS as ATTN_MODULES
from temper.services.models.families import EXPERTS_PATH, LINEAR_ATTN_LINEARS, MLA_LINEARS
from temper.services.models.families import UNEMBED_LINEARS as UNEMBED_MODULES
from temper.services.models.families import MLP_LINEARS as MLP_MODULES

PEFT_PREFIX = "base_model.model."
# peft's target_parameters keys of the fused routed experts (the projections an MoE "mlp" group adapts)
EXPERT_TARGETS = {f"{EXPERTS_PATH}.gate_up_proj": "gate_up", f"{EXPERTS_PATH}.down_proj": "down"}
_LINEAR_NAMES = tuple(dict.fromkeys(ATTN_MODULES + MLA_LINEARS + LINEAR_ATTN_LINEARS + MLP_MODULES + UNEMBED_MODULES))


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]           # short module names, e.g. ("q_proj", "v_proj"), and EXPERT_TARGETS keys
    dropout: float = 0.0
    # each routed expert's rank (its A is r x in, its B out x r); alpha / expert_rank scales it. 0: no
    # expert targets, or not resolved yet (LoraModel.resolve: rank // num_experts_per_tok)
    expert_rank: int = 0

    @property
    def linear_targets(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets if t not in EXPERT_TARGETS)

    @property
    def expert_targets(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets if t in EXPERT_TARGETS)

    def peft_config(self, base_model: str) -> dict:
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": self.rank,
            "lora_alpha": self.alpha, "lora_dropout": self.dropout, "target_modules": sorted(self.linear_targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None,
        }
        if self.expert_targets:
            # peft's ParamWrapper on the fused expert tensors; their rank through rank_pattern (keys match
            # the parameter's full name, which ends with the target key). On transformers 5, peft rewrites
            # target_modules gate_proj/up_proj/down_proj of an MoE model into its routed experts (it takes them
            # for a transformers-4 checkpoint), so the dense MLPs' and shared experts' projections are named
            # through their weights instead: the same tensors, names and math as target_modules LoRA.
            dense = sorted(t for t in self.linear_targets if t in MLP_MODULES)
            config["target_modules"] = sorted(t for t in self.linear_targets if t not in MLP_MODULES)
            config["target_parameters"] = sorted(self.expert_targets) + [f"{t}.weight" for t in dense]
            if self.expert_rank != self.rank:
                config["rank_pattern"] = {t: self.expert_rank for t in sorted(self.expert_targets)}
        return config

    @classmethod
    def from_peft_config(cls, config: dict) -> "AdapterSpec":
        targets = config.get("target_modules") or []
        parameters = config.get("target_parameters") or []
        if isinstance(targets, str) or isinstance(parameters, str):
            raise ValueError("regex target_modules / target_parameters are not supported; list module names")
        if not all(isinstance(t, str) for t in [*targets, *parameters]):
            raise ValueError("target_modules and target_parameters must be lists of names")
        dense = [p.removesuffix(".weight") for p in parameters if p.removesuffix(".weight") in MLP_MODULES]
        parameters = [p for p in parameters if p.removesuffix(".weight") not in MLP_MODULES]
        targets = [*targets, *dense]
        unknown = sorted(set(parameters) - set(EXPERT_TARGETS))
        if unknown:
            raise ValueError(f"target_parameters: {len(unknown)} name(s) are neither routed-expert projections "
                             f"{sorted(EXPERT_TARGETS)} nor MLP weights ({', '.join(f'{m}.weight' for m in MLP_MODULES)})")
        rank = int(config["r"])
        pattern = config.get("rank_pattern") or {}
        if not isinstance(pattern, dict) or set(pattern) - set(parameters):
            raise ValueError("rank_pattern may only name the routed-expert target_parameters")
        expert_ranks = {int(pattern.get(t, rank)) for t in parameters}
        if len(expert_ranks) > 1:
            raise ValueError("rank_pattern: every routed-expert projection must have the same rank")
        return cls(rank=rank, alpha=float(config.get("lora_alpha", config["r"])),
                   targets=tuple(sorted([*targets, *parameters])), dropout=float(config.get("lora_dropout", 0.0) or 0.0),
                   expert_rank=expert_ranks.pop() if expert_ranks else 0)


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
        self.experts: dict[str, MultiLoraExperts] = {}  # module path -> wrapper of a layer's routed experts
        self.adapters: dict[str, Adapter] = {}
        try:
            self.family: families.Family | None = families.check_config(model.config)
            self.family_error = ""
        except families.UnknownFamily as exc:  # the model still runs; no adapter can be added (``add``)
            self.family, self.family_error = None, str(exc)
        layout = self.family.experts if self.family else None
        # a vision-language family's tower and merger linears: LoRA targets only when a run names them
        self.vision: families.VisionLayout | None = self.family.vision if self.family else None
        vision_prefix = f"{self.vision.tower}." if self.vision else None
        for path, module in list(model.named_modules()):
            short = path.rsplit(".", 1)[-1]
            parent_path, _, name = path.rpartition(".")
            in_tower = vision_prefix is not None and path.startswith(vision_prefix)
            if isinstance(module, nn.Linear) and (short in self.vision.linears if in_tower else short in _LINEAR_NAMES):
                wrapper = MultiLoraLinear(module, self.router)
            elif layout is not None and type(module).__name__ in layout.class_names and path.endswith(EXPERTS_PATH):
                wrapper = MultiLoraExperts(module, layout, self.router)
            else:
                continue
            setattr(model.get_submodule(parent_path) if parent_path else model, name, wrapper)
            (self.layers if isinstance(wrapper, MultiLoraLinear) else self.experts)[path] = wrapper
        if self.family and self.family.moe and not self.experts:
            self.family_error = (f"{self.family.name} model has no {'/'.join(layout.class_names)} modules at "
                                 f"*.{EXPERTS_PATH} (a module layout Temper does not know)")
        self.top_k = int(getattr(getattr(model.config, "text_config", None) or model.config, "num_experts_per_tok", 0) or 0)
        # routed experts see the batch as (tokens, hidden): they need the rows of the input (Routing.token_slots)
        model.get_input_embeddings().register_forward_hook(self._note_batch_rows)
        self.device = next(model.parameters()).device
        # whether the wrapped layers checkpoint (checkpoint_decoder_layers), switched per pass and per
        # thread (checkpointing_enabled): deterministic passes run two at a time on two threads
        self._checkpointing_default = False
        self._checkpointing_local = threading.local()

    def _note_batch_rows(self, _module, _inputs, output) -> None:
        routing = self.router.current
        if routing is not None:
            routing.batch_rows = int(output.shape[0])

    def available_targets(self) -> set[str]:
        names = {p.rsplit(".", 1)[-1] for p in self.layers}
        return names | (set(EXPERT_TARGETS) if self.experts else set())

    def group_targets(self, attn: bool = False, mlp: bool = False, unembed: bool = False,
                      vision: bool = False) -> tuple[str, ...]:
        """The targets of an adapter that trains these groups of this model, sorted: attention (its
        family's projections, MLA's included), MLP (dense MLPs, shared experts and routed experts), the
        unembedding, the vision tower and merger (a vision-language family's). Raises ValueError for a
        model of no known family, and for ``vision`` on a text-only one."""
        if self.family is None:
            raise ValueError(self.family_error)
        if vision and self.vision is None:
            raise ValueError(f"train_vision needs a vision-language base model; {self.base_model_name} "
                             f"({self.family.name}) takes text only")
        present = {p.rsplit(".", 1)[-1] for p in self.layers}
        wanted = ((self.family.attention if attn else ()) + (self.family.mlp if mlp else ())
                  + (UNEMBED_MODULES if unembed else ()) + (self.vision.linears if vision else ()))
        targets = {t for t in wanted if t in present}
        if mlp and self.experts:
            targets |= set(EXPERT_TARGETS)
        return tuple(sorted(targets))

    def vision_targets(self, key: str) -> tuple[str, ...]:
        """The vision tower's and merger's layers adapter ``key`` adapts (none: its images see the base tower)."""
        adapter = self.adapters.get(key)
        if adapter is None or self.vision is None:
            return ()
        return tuple(t for t in adapter.spec.targets if t in self.vision.linears)

    def resolve(self, spec: AdapterSpec) -> AdapterSpec:
        """``spec`` checked against this model, its expert rank filled in (ValueError naming the field)."""
        if self.family is None or self.family_error:
            raise ValueError(self.family_error)
        missing = set(spec.targets) - self.available_targets()
        if missing:
            raise ValueError(f"the base model ({self.family.name}) has no {sorted(missing)} layers to adapt")
        expert_rank = resolve_expert_rank(rank=spec.rank, expert_rank=spec.expert_rank, dropout=spec.dropout,
                                          has_experts=bool(self.experts), adapts_experts=bool(spec.expert_targets),
                                          top_k=self.top_k, model=f"this {self.family.name} model", family=self.family.name)
        return replace(spec, expert_rank=expert_rank)

    def add(self, key: str, spec: AdapterSpec, seed: int | None = None) -> Adapter:
        """Adds an adapter for ``spec`` (resolved: ``resolve``); the Adapter's spec is the resolved one."""
        if key in self.adapters:
            raise KeyError(f"adapter {key} exists")
        spec = self.resolve(spec)
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
        if spec.expert_targets:
            for path, experts in self.experts.items():
                weights = experts.new_weights(spec.expert_rank, spec.alpha, self.device, generator)
                experts.adapters[key] = weights
                for projection, prefix in _expert_prefixes(experts).items():
                    adapter.params[f"{PEFT_PREFIX}{path}.{prefix}lora_A.weight"] = getattr(weights, f"{projection}_A")
                    adapter.params[f"{PEFT_PREFIX}{path}.{prefix}lora_B.weight"] = getattr(weights, f"{projection}_B")
        self.adapters[key] = adapter
        return adapter

    def param_shapes(self, spec: AdapterSpec) -> dict[str, tuple[int, int]]:
        """The peft-format names and shapes of the parameters ``add`` would create for ``spec`` (resolved)."""
        shapes = {}
        for path, layer in self.layers.items():
            if path.rsplit(".", 1)[-1] in spec.targets:
                shapes[f"{PEFT_PREFIX}{path}.lora_A.weight"] = (spec.rank, layer.in_features)
                shapes[f"{PEFT_PREFIX}{path}.lora_B.weight"] = (layer.out_features, spec.rank)
        if spec.expert_targets and spec.expert_rank > 0:
            for path, experts in self.experts.items():
                width = spec.expert_rank * experts.num_experts
                for projection, prefix in _expert_prefixes(experts).items():
                    fan_in, fan_out = experts.shapes[projection]
                    shapes[f"{PEFT_PREFIX}{path}.{prefix}lora_A.weight"] = (width, fan_in)
                    shapes[f"{PEFT_PREFIX}{path}.{prefix}lora_B.weight"] = (fan_out, width)
        return shapes

    def remove(self, key: str) -> None:
        self.adapters.pop(key)
        for layer in self.layers.values():
            layer.adapters.pop(key, None)
        for experts in self.experts.values():
            experts.adapters.pop(key, None)

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

    @property
    def checkpointing(self) -> bool:
        return getattr(self._checkpointing_local, "on", self._checkpointing_default)

    @checkpointing.setter
    def checkpointing(self, value: bool) -> None:
        self._checkpointing_default = value

    @contextlib.contextmanager
    def checkpointing_enabled(self, enabled: bool):
        """Switch the layers wrapped by ``checkpoint_decoder_layers`` on or off for one pass, on this
        thread only (passes on other threads keep their own switch)."""
        local = self._checkpointing_local
        had, previous = hasattr(local, "on"), getattr(local, "on", None)
        local.on = enabled
        try:
            yield
        finally:
            if had:
                local.on = previous
            else:
                del local.on

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

    def files(self, key: str) -> dict[str, bytes]:
        """The peft checkpoint of adapter ``key``, file name -> bytes (what ``save`` writes)."""
        config = self.adapters[key].spec.peft_config(self.base_model_name)
        if self.vision_targets(key):
            # peft matches target_modules by name suffix: keep it off the tower's modules of those short
            # names that are no linear (the patch embedding's Conv3d ``proj``), as this model does
            wrapped = set(self.layers)
            config["exclude_modules"] = sorted(
                path for path, _ in self.model.named_modules()
                if path.startswith(f"{self.vision.tower}.") and path.rsplit(".", 1)[-1] in self.vision.linears
                and path not in wrapped)
        return {"adapter_model.safetensors": safetensors_bytes(self.state_dict(key)),
                "adapter_config.json": json.dumps(config, indent=2, sort_keys=True).encode()}

    def save(self, key: str, folder: Path) -> None:
        for name, data in self.files(key).items():
            (folder / name).write_bytes(data)

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


def _expert_prefixes(experts: MultiLoraExperts) -> dict[str, str]:
    """Where peft puts each projection's LoRA below the experts module: it wraps the targeted parameters
    one inside the other in the module's parameter order, so the first is under ``base_layer.``."""
    order = [n for n, _ in experts.base.named_parameters(recurse=False)]
    names = {"gate_up": experts.layout.gate_up, "down": experts.layout.down}
    ranked = sorted(names, key=lambda projection: order.index(names[projection]))
    return {projection: "base_layer." * (len(ranked) - 1 - i) for i, projection in enumerate(ranked)}
