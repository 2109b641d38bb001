"""Where a base model fits: per-rank memory of a trainer group of N ranks (issue 20, model sharding).

    python -m temper.plan --model <folder or config.json> --devices 8x141GiB [--tokens 8192]
                          [--adapters 16 --rank 32] [--dtype bfloat16] [--width 4096] [--json]

For N = 1, 2, 4, 8 ... up to the device count, one rank's memory:

- base weights / N: FSDP2 shards every frozen base parameter evenly over the N ranks; counted from
  the config alone (the model built on the meta device, no weights loaded), in ``--dtype``;
- gathered: with N > 1, FSDP2 all-gathers a decoder layer's full weights to run it, and prefetches
  the next (2 x the largest layer), and keeps the root's parameters (embeddings, final norm,
  unembedding) gathered for the whole pass;
- activations: one forward+backward pass over the rows this rank processes (the cycle's ``--tokens``
  split data-parallel over the ranks, rows of ``--width``), ``ActivationModel.pass_bytes``
  (services/trainer/memory.py): the total counts it checkpointed (the least it needs); the trainer
  stores it where the stored pass fits too (the table says which);
- adapters: ``--adapters`` resident LoRA adapters of ``--rank`` on attention and MLP linears (the
  routed experts' per-expert pairs at rank // top_k), float32 weights + gradients + Adam's two
  moments (16 bytes a parameter), replicated on every rank;
- overhead: a fixed ``--overhead-gib`` per rank (CUDA context, communication buffers, allocator slack);
- images (a vision-language model): ``--images`` per cycle of ``--image-tokens`` tokens each are part
  of ``--tokens`` (an image is its N tokens in its row); the vision tower's weights are in the base
  weights, its outputs (and its activations with ``--train-vision``, whose adapters also adapt the
  tower's and merger's linears) in the pass (``TowerShape``). A sharded group (N > 1) takes no images.

Not estimated: the adapters' per-pass stacked copies and the optimizer step's temporaries, the
sampler's memory (KV cache), micro-batching a pass below one rank's rows. docs/plan.md says more.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from temper.devices import GIB, Devices, parse_devices  # noqa: F401  (public here too)

DTYPES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "float": 4}
ADAPTER_BYTES_PER_PARAM = 16       # float32 weight + gradient + Adam's exp_avg and exp_avg_sq
DEFAULT_OVERHEAD_GIB = 2.0


def rank_counts(devices: int) -> list[int]:
    """1, 2, 4, 8 ... up to ``devices`` (and ``devices`` itself when it is no power of two)."""
    counts, n = [], 1
    while n <= devices:
        counts.append(n)
        n *= 2
    if counts[-1] != devices:
        counts.append(devices)
    return counts


# ---- the model, from its config -------------------------------------------------------------------


def load_config(path: str | Path):
    """A transformers config from a model folder (its config.json) or a config JSON file."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json")
        return AutoConfig.from_pretrained(str(path))
    if not path.is_file():
        raise ValueError(f"{path}: no such model folder or config file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{path} is not a transformers config (no model_type)")
    return AutoConfig.for_model(**raw)


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of a model from its config (built on the meta device)."""
    params: int                  # every base parameter (tied ones once)
    largest_layer_params: int    # the largest decoder layer (an FSDP2 unit)
    root_params: int             # outside the decoder layers: embeddings, final norm, unembedding
    layers: int
    lora_params: int             # one adapter of ``rank`` on attention + MLP (+ routed experts)
    lora_linear_params: int      # of which on nn.Linear layers
    lora_expert_params: int      # of which on routed experts' (expert, projection) pairs
    rank: int
    expert_rank: int
    family: str


def count_parameters(config, rank: int, train_vision: bool = False) -> ModelCounts:
    """Base parameters, the largest decoder layer, and the LoRA parameters of one adapter of ``rank``
    that trains attention and MLP (as ``LoraModel.group_targets(attn=True, mlp=True)``: every
    nn.Linear of the family's attention and MLP names, dense MLPs and shared experts included; the
    routed experts' gate_up and down projections per expert at ``rank // top_k``; with ``train_vision``
    the vision tower's and merger's linears too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from temper.services.lora.expert_rank import default_expert_rank
    from temper.services.models import families

    family = families.check_config(config)
    text = getattr(config, "text_config", None) or config
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0) if family.moe else 0
    expert_rank = default_expert_rank(rank, top_k) if family.moe else 0
    if family.moe and expert_rank < 1:
        raise ValueError(f"rank {rank} spread over num_experts_per_tok={top_k} leaves no rank per expert: use rank >= {top_k}")
    if train_vision and family.vision is None:
        raise ValueError(f"--train-vision needs a vision-language model; {family.name} takes text only")
    auto = AutoModelForImageTextToText if family.vision is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    decoder = _decoder_layers(model)
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in decoder]
    linear_names = set(family.attention) | set(family.mlp)
    linear = experts = 0
    tower = f"{family.vision.tower}." if family.vision is not None else None
    for path, module in model.named_modules():
        short = path.rsplit(".", 1)[-1]
        in_tower = tower is not None and path.startswith(tower)
        if isinstance(module, torch.nn.Linear) and (short in family.vision.linears and train_vision if in_tower
                                                    else short in linear_names):
            linear += rank * (module.in_features + module.out_features)
        elif family.experts is not None and type(module).__name__ in family.experts.class_names \
                and path.endswith(families.EXPERTS_PATH):
            for name in (family.experts.gate_up, family.experts.down):
                weight = getattr(module, name)        # (experts, out, in) or transposed: in + out either way
                experts += weight.shape[0] * expert_rank * (weight.shape[1] + weight.shape[2])
    return ModelCounts(params=int(params), largest_layer_params=int(max(layer_params, default=0)),
                       root_params=int(params - sum(layer_params)), layers=len(layer_params),
                       lora_params=int(linear + experts), lora_linear_params=int(linear), lora_expert_params=int(experts),
                       rank=rank, expert_rank=expert_rank, family=family.name)


def _decoder_layers(model):
    import torch

    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return list(layers)
    return []


# ---- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlan:
    """One layout: N ranks, one device each; every ``*_bytes`` is one rank's."""
    ranks: int
    tokens_per_rank: int
    width: int
    base_bytes: int
    gathered_bytes: int
    activation_bytes: int       # the least one pass needs (checkpointed; ``total_bytes`` counts this)
    activations: str            # how the trainer would run it: "stored" where the stored pass fits too, else "checkpointed"
    adapter_bytes: int
    overhead_bytes: int
    total_bytes: int
    capacity_bytes: int
    fits: bool
    stored_bytes: int = 0       # the pass with every layer's activations stored
    checkpointed_bytes: int = 0  # the pass with every decoder layer checkpointed
    max_adapters: int = 0       # resident adapters that fit beside the rest (activations checkpointed if need be)
    notes: list[str] = field(default_factory=list)

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes


@dataclass
class Plan:
    model: str
    family: str
    dtype: str
    devices: Devices
    tokens: int
    adapters: int
    rank: int
    counts: ModelCounts
    layouts: list[RankPlan]
    catalogue_layout: dict | None = None

    def to_json(self) -> dict:
        layouts = [{**asdict(p), "headroom_bytes": p.headroom_bytes} for p in self.layouts]
        return {"model": self.model, "family": self.family, "dtype": self.dtype,
                "devices": {"count": self.devices.count, "bytes_each": self.devices.bytes_each, "kind": self.devices.kind},
                "tokens": self.tokens, "adapters": self.adapters, "rank": self.rank, "counts": asdict(self.counts),
                "layouts": layouts, "catalogue_layout": self.catalogue_layout,
                "fitting_ranks": [p.ranks for p in self.layouts if p.fits]}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(set(DTYPES))}") from None


def plan_layouts(config, devices: Devices, tokens: int = 8192, adapters: int = 1, rank: int = 32, dtype: str = "bfloat16",
                 width: int = 0, overhead_gib: float = DEFAULT_OVERHEAD_GIB, ranks: list[int] | None = None,
                 counts: ModelCounts | None = None, model_name: str = "", images: int = 0, image_tokens: int = 0,
                 train_vision: bool = False) -> Plan:
    """Every layout of N ranks (``ranks``; default ``rank_counts(devices.count)``) with one rank's
    memory (the module docstring says what is counted). ``width``: the padded row length (0: the
    rank's tokens in one row; otherwise at most the rank's tokens). ``images`` of ``image_tokens``
    tokens each: part of ``tokens``, through the vision tower (trained with ``train_vision``)."""
    import torch

    from temper.services.trainer.memory import ActivationModel
    from temper.services.trainer.numerics import default_logprob_chunk_tokens

    if tokens < 1:
        raise ValueError(f"tokens {tokens} must be at least 1")
    if adapters < 0 or rank < 1:
        raise ValueError(f"adapters {adapters} must be >= 0 and rank {rank} >= 1")
    if images < 0 or image_tokens < 0 or images * image_tokens > tokens:
        raise ValueError(f"{images} images x {image_tokens} image tokens must be >= 0 and within --tokens {tokens}")
    if images and getattr(config, "vision_config", None) is None:
        raise ValueError("--images needs a vision-language model (its config has no vision_config)")
    size = dtype_bytes(dtype)
    torch_dtype = torch.bfloat16 if size == 2 and dtype.lower() in ("bfloat16", "bf16") else (
        torch.float16 if size == 2 else torch.float32)
    counts = counts or count_parameters(config, rank, train_vision)
    activation = ActivationModel.from_config(config, torch_dtype, lora_rank=rank, device=devices.kind)
    chunk = default_logprob_chunk_tokens(torch.device(devices.kind), activation.vocab)
    experts = activation.experts
    overhead = int(overhead_gib * GIB)
    layouts = []
    for n in ranks or rank_counts(devices.count):
        if n > devices.count:
            raise ValueError(f"{n} ranks need {n} devices; {devices} has {devices.count}")
        per_rank = math.ceil(tokens / n)
        row = min(width, per_rank) if width > 0 else per_rank
        row_tokens = math.ceil(per_rank / row) * row      # rows of ``row`` tokens, the last one padded
        base = math.ceil(counts.params / n) * size
        gathered = 0 if n == 1 else (2 * counts.largest_layer_params + counts.root_params) * size
        adapter = adapters * counts.lora_params * ADAPTER_BYTES_PER_PARAM
        fixed = base + gathered + adapter + overhead
        mine = math.ceil(images * image_tokens / n)          # image tokens among this rank's
        trained = mine if train_vision else 0
        stored = int(activation.pass_bytes(row_tokens, row, False, chunk, mine, trained))
        checkpointed = int(activation.pass_bytes(row_tokens, row, True, chunk, mine, trained))
        act = min(stored, checkpointed)     # the least the pass needs: checkpointed
        mode = "stored" if fixed + stored <= devices.bytes_each else "checkpointed"
        total = fixed + act
        per_adapter = counts.lora_params * ADAPTER_BYTES_PER_PARAM
        spare = devices.bytes_each - (base + gathered + overhead + min(stored, checkpointed))
        max_adapters = max(0, spare // per_adapter) if per_adapter else 0
        notes = []
        if images and n > 1:
            notes.append("a sharded trainer group takes no images (image datums need a single-process trainer)")
        if experts and experts % n:
            notes.append(f"{experts} experts % {n} ranks = {experts % n}: no even expert placement")
        layouts.append(RankPlan(ranks=n, tokens_per_rank=per_rank, width=row, base_bytes=base, gathered_bytes=gathered,
                                activation_bytes=act, activations=mode, adapter_bytes=adapter, overhead_bytes=overhead,
                                total_bytes=total, capacity_bytes=devices.bytes_each, fits=total <= devices.bytes_each,
                                stored_bytes=stored, checkpointed_bytes=checkpointed, max_adapters=int(max_adapters),
                                notes=notes))
    return Plan(model=model_name, family=counts.family, dtype=dtype, devices=devices, tokens=tokens, adapters=adapters,
                rank=rank, counts=counts, layouts=layouts)


# ---- output ---------------------------------------------------------------------------------------


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f}"


def render(plan: Plan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=140)
    c = plan.counts
    title = (f"{plan.model or 'model'} ({plan.family}, {c.params / 1e9:,.2f}B parameters, {plan.dtype}) on {plan.devices}: "
             f"{plan.tokens} tokens a cycle, {plan.adapters} adapter(s) of rank {plan.rank}"
             + (f" (experts {c.expert_rank})" if c.expert_rank else ""))
    table = Table(title=title, title_justify="left")
    for column in ("ranks", "tokens/rank", "base/N", "gathered", "activations", "adapters", "overhead", "total",
                   "headroom", "fits", "max adapters"):
        table.add_column(column, justify="left" if column in ("activations", "fits") else "right", no_wrap=True)
    catalogue_ranks = (plan.catalogue_layout or {}).get("ranks_per_trainer")
    for p in plan.layouts:
        fits = "[green]yes[/green]" if p.fits else "[red]no[/red]"
        if catalogue_ranks == p.ranks:
            fits += " (catalogue)"
        headroom = _gib(p.headroom_bytes)
        table.add_row(str(p.ranks), str(p.tokens_per_rank), _gib(p.base_bytes), _gib(p.gathered_bytes),
                      f"{_gib(p.activation_bytes)} ({p.activations} {_gib(p.stored_bytes)})" if p.activations == "stored"
                      else f"{_gib(p.activation_bytes)} (checkpointed)", _gib(p.adapter_bytes), _gib(p.overhead_bytes),
                      _gib(p.total_bytes), headroom if p.fits else f"[red]{headroom}[/red]", fits, str(p.max_adapters))
    console.print(table)
    console.print(f"GiB per rank, of {_gib(plan.devices.bytes_each)} GiB a device. Activations: checkpointed, what the total counts "
                  f"(stored, and its size, where the stored pass fits too); max adapters: resident adapters that "
                  f"would fit at that N. One adapter: "
                  f"{c.lora_params / 1e6:,.1f}M parameters ({c.lora_linear_params / 1e6:,.1f}M on linears, "
                  f"{c.lora_expert_params / 1e6:,.1f}M on routed experts), x16 bytes (float32 weights, grads, Adam).")
    fitting = [p.ranks for p in plan.layouts if p.fits]
    console.print(f"Fits with {', '.join(map(str, fitting))} rank(s): the smallest is ranks_per_trainer={fitting[0]}."
                  if fitting else "Fits no layout on these devices.")
    for p in plan.layouts:
        for note in p.notes:
            console.print(f"  N={p.ranks}: {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m temper.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model folder with config.json, or a config.json path")
    parser.add_argument("--devices", required=True, help="e.g. 8x141GiB, 2x80GB, cpu:2x24GiB")
    parser.add_argument("--tokens", type=int, default=8192, help="padded tokens of one training cycle, over all ranks")
    parser.add_argument("--width", type=int, default=0, help="padded row length (default: a rank's tokens in one row)")
    parser.add_argument("--adapters", type=int, default=1, help="resident adapters (each replicated on every rank)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (routed experts: rank // top_k)")
    parser.add_argument("--dtype", default="bfloat16", help="the base weights' and activations' dtype")
    parser.add_argument("--overhead-gib", type=float, default=DEFAULT_OVERHEAD_GIB, help="fixed per-rank overhead")
    parser.add_argument("--name", default=None, help="the model's name in the catalogue (default: the config's)")
    parser.add_argument("--catalogue", default=None,
                        help="layout catalogue JSON (default: $TEMPER_MODEL_CATALOGUE); its layout is checked and marked")
    parser.add_argument("--images", type=int, default=0, help="images per cycle (vision-language models; part of --tokens)")
    parser.add_argument("--image-tokens", type=int, default=0, help="tokens per image (N: the model's processor's count)")
    parser.add_argument("--train-vision", action="store_true", help="adapters also train the vision tower and merger")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        from temper.services.models.catalogue import Catalogue, check_divides

        devices = parse_devices(args.devices)
        config = load_config(args.model)
        name = args.name or getattr(config, "_name_or_path", "") or str(args.model)
        catalogue = Catalogue.from_json(args.catalogue) if args.catalogue is not None else Catalogue.from_env()
        plan = plan_layouts(config, devices, tokens=args.tokens, adapters=args.adapters, rank=args.rank, dtype=args.dtype,
                            width=args.width, overhead_gib=args.overhead_gib, model_name=name, images=args.images,
                            image_tokens=args.image_tokens, train_vision=args.train_vision)
        if name in catalogue:
            layout = catalogue.layout(name)
            check_divides(config, layout, name)
            plan.catalogue_layout = layout.model_dump()
    except ValueError as exc:
        print(f"temper.plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        render(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
