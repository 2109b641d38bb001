"""GPU multi-tenant benchmark: co-batched vs time-sliced LoRA training passes on a ~1B Llama.

Self-contained on purpose: it needs only torch, transformers and safetensors plus the repo's
``services/lora`` package (the MultiLoraLinear layers the trainer uses) and the trainer's numerics
(``services/trainer/numerics.py``), reached through a tiny import shim, so it runs on a machine
where temper is not installed and grpc, protobuf and pydantic may be missing. The model is
randomly initialised from a config (no weights, no hub).

Each pass is the trainer's own ``numerics.target_logprobs_pass``: every row group routed to its
own adapter through ``LoraModel.route``, the decoder, then the lm_head + target logprobs over
chunks of tokens recomputed in the backward pass (activation checkpointing); then the summed
cross-entropy (weights 1) and backward.

Variants, interleaved in a rotating order, medians reported with the raw samples:
  cobatched       one pass over every tenant's rows (T tenants x R rows x L tokens, T adapters)
  time_sliced     T passes, one tenant (R rows, one adapter) per pass
  single_adapter  one pass over the same T x R rows, all on one adapter

  cobatch_gain     = time_sliced / cobatched          goal >= 3
  cobatch_overhead = cobatched / single_adapter       goal <= 1.10

Every pass runs inside ``LoraModel.stacking()`` as the trainer's cycles do (stacked adapter weights
built once, gradients handed back to each adapter's parameters at the end), with LoRA math in the
activations' dtype (``--lora-math float32`` for the float32 path). Also reported:

  mfu              model FLOPs / (median seconds x peak FLOP/s) of each variant. Convention:
                   6 N T for the frozen base (N = the parameters of every matmul: decoder linears and
                   lm_head, no embedding; forward 2NT + backward-to-activations 2NT is what runs,
                   the usual 6NT counts the weight gradients a frozen base skips) plus the LoRA terms
                   6 r (in + out) T per adapted linear (forward, input gradient, A/B gradients);
                   attention's T^2 FLOPs are not counted. Peak: --peak-tflops, else a table of
                   dense bf16 peaks by GPU name (H100/H200 SXM 989).
  scaling          aggregate tokens/s of one co-batched pass of k tenants (each --rows x --tokens)
                   for k = 1, 2, 4, 8, 16, relative to k = 1 (interleaved repetitions, medians).
  lora_math        max relative gradient error of LoRA math in bf16 against float32 on one pass.
  grouped          ragged tenants (1..3 rows each): grouped_mm (CUDA) against padded batched
                   matmuls, time and max relative gradient error.

  expert_rank_check (--family qwen3_moe, --compare-expert-rank R): one co-batched pass with a second
                   set of adapters whose routed experts have rank R (0: rank // top_k, the trainer's
                   default) against the main co-batched pass: grouped_mm needs the expert rank to be a
                   multiple of 8 in bf16, otherwise services/lora/experts.py pads the (expert, adapter)
                   slices for batched matmuls (or loops over them where padding would be too uneven).

--family qwen3_moe: a random mixture-of-experts model (Qwen3-MoE; --experts, --top-k,
--moe-intermediate, --head-dim) whose adapters also train the routed experts
(``LoraModel.group_targets(attn=True, mlp=True)``, expert rank --expert-rank, 0: rank // top_k). Its
MFU counts the active parameters: attention, router and lm_head, plus top_k experts per token in
every MoE layer, and the LoRA terms of the experts a token is routed to.

    python benchmarks/gpu_multitenant.py --device cuda --dtype bfloat16     # ~1.1B params, 16 tenants
    python benchmarks/gpu_multitenant.py --smoke                            # tiny config on CPU, seconds
    python benchmarks/gpu_multitenant.py --smoke --family qwen3_moe         # tiny MoE on CPU, seconds
    python benchmarks/gpu_multitenant.py --family qwen3_moe ... --dry-run   # the config, parameters and a
                                                                            # memory estimate; builds nothing

The last stdout line is the result JSON (also written to --json-out when given).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import report  # medians, goal verdicts, the ratio lines: standard library only (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parent.parent
GOALS = {"cobatch_gain": (">=", 3.0), "cobatch_overhead": ("<=", 1.10)}


def install_temper_shim() -> None:
    """Make ``temper.services.lora`` and ``temper.services.trainer.numerics`` importable from this
    checkout without installing temper: register namespace-like ``temper`` and ``temper.services``
    modules whose ``__path__`` points at the repo folders (pyproject maps temper.services ->
    services/). Nothing else of temper is imported, so no grpc/protobuf/pydantic is needed."""
    for name, folder in (("temper", REPO / "temper"), ("temper.services", REPO / "services")):
        module = types.ModuleType(name)
        module.__path__ = [str(folder)]
        module.__package__ = name
        sys.modules[name] = module
    sys.modules["temper"].services = sys.modules["temper.services"]


def model_config(args):
    """The transformers config of --family at the requested shape."""
    if args.family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            moe_intermediate_size=args.moe_intermediate, num_experts=args.experts, num_experts_per_tok=args.top_k,
            norm_topk_prob=True, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, head_dim=args.head_dim or args.hidden // args.heads,
            max_position_embeddings=max(2048, args.tokens), tie_word_embeddings=False,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max(2048, args.tokens),
        tie_word_embeddings=False,
    )


def build_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(args)
    dtype = getattr(torch, args.dtype)
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # build directly in the target dtype and on the device (fast, no fp32 copy)
    try:
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def dry_run(args) -> dict:
    """The config, its parameter counts and a rough bf16 memory estimate, without building anything
    (the model is instantiated on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    tokens = args.tenants * args.rows * args.tokens
    moe = args.family == "qwen3_moe"
    # stored activations per token and layer, no checkpointing: ~ (8 hidden + 3 q/kv-widths) for attention and
    # norms, plus per routed assignment the gathered input, gate_up, GLU and down outputs (MoE), or the MLP's
    width = args.heads * (args.head_dim or args.hidden // args.heads)
    attention = 8 * args.hidden + 3 * width
    mlp = args.top_k * (2 * args.hidden + 4 * args.moe_intermediate) if moe else 2 * args.hidden + 4 * args.intermediate
    activations = tokens * args.layers * (attention + mlp) * element
    return {"dry_run": True, "family": args.family, "config": config.to_dict(), "params": params,
            "weights_gib": params * element / 2**30, "tokens_per_cobatched_pass": tokens,
            "activations_gib_estimate": activations / 2**30,
            "total_gib_estimate": (params * element + activations) / 2**30}


def forward_backward(lora, ids, targets, routing, chunk: int):
    """One training pass as the trainer runs it (cross-entropy, weights 1, no padding), in a
    stacking() scope as the trainer's cycles are."""
    import torch

    from temper.services.trainer.numerics import target_logprobs_pass

    mask = torch.ones_like(ids, dtype=torch.bool)
    with lora.stacking():
        lp = target_logprobs_pass(lora, ids, mask, targets.unsqueeze(-1), routing, chunk)
        loss = -lp.sum()
        loss.backward()
    return lp.detach().cpu()  # the engine copies every row's logprobs back to the host: one sync per pass


PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16


def peak_flops(args, name: str | None) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if name and key in name:
            return tflops * 1e12
    return None


def flops_per_token(model, lora, spec) -> dict:
    """6 N per token for the frozen base's matmul parameters a token goes through (decoder linears,
    lm_head; for an MoE model the routers and top_k of every layer's routed experts), plus 6 r (in +
    out) per adapted linear and, per routed expert a token reaches, 6 r_e (in + out) per adapted
    projection; the convention of the module docstring."""
    from torch import nn

    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    lora_terms = sum(6 * spec.rank * (layer.in_features + layer.out_features)
                     for path, layer in lora.layers.items() if path.rsplit(".", 1)[-1] in spec.targets)
    experts = getattr(lora, "experts", {})
    expert_params = expert_lora = router = 0
    if experts:
        top_k = lora.top_k
        for path, wrapper in experts.items():
            per_expert = sum(fan_in * fan_out for fan_in, fan_out in wrapper.shapes.values())
            expert_params += top_k * per_expert
            if spec.expert_targets:
                expert_lora += top_k * sum(6 * spec.expert_rank * (fan_in + fan_out)
                                           for fan_in, fan_out in wrapper.shapes.values())
        for name, p in model.named_parameters():  # the routers' weights (not nn.Linear in transformers 5)
            if name.endswith("mlp.gate.weight") and p.dim() == 2:
                router += p.numel()
    base = 6.0 * (matmul_params + expert_params + router)
    return {"base_matmul_params": matmul_params + expert_params + router, "active_expert_params": expert_params,
            "router_params": router, "base": base, "lora": float(lora_terms + expert_lora),
            "lora_experts": float(expert_lora), "total": base + lora_terms + expert_lora}


def grad_vectors(lora, keys):
    import torch

    return {k: torch.cat([p.grad.float().flatten() for p in lora.adapters[k].params.values()]) for k in keys}


def max_relative_error(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--rows", type=int, default=2, help="datums per tenant")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per datum")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--family", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--experts", type=int, default=128, help="qwen3_moe: routed experts")
    parser.add_argument("--top-k", type=int, default=8, help="qwen3_moe: experts per token")
    parser.add_argument("--moe-intermediate", type=int, default=768, help="qwen3_moe: each expert's intermediate size")
    parser.add_argument("--head-dim", type=int, default=0, help="attention head dim (0: hidden / heads)")
    parser.add_argument("--expert-rank", type=int, default=0, help="qwen3_moe: routed experts' LoRA rank (0: rank // top_k)")
    parser.add_argument("--compare-expert-rank", type=int, default=-1,
                        help="qwen3_moe: also time one co-batched pass with adapters of this expert rank (0: rank // top_k; "
                             "-1: skip)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the config, parameters and a memory estimate; build nothing")
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per lm_head/log-softmax chunk")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--lora-math", choices=("activation", "float32"), default="activation",
                        help="dtype of the LoRA matmuls (LoraModel lora_math_dtype)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak dense FLOP/s for the MFU (default: by GPU name)")
    parser.add_argument("--scaling", type=int, nargs="*", default=[1, 2, 4, 8, 16], help="tenant counts of the scaling curve")
    parser.add_argument("--scaling-reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU in float32: checks the script runs")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.tenants, args.rows, args.tokens, args.rank = 4, 2, 32, 4
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab = 64, 128, 2, 4, 2, 512
        args.chunk, args.warmup, args.reps = 64, 1, 3
        args.scaling, args.scaling_reps = [1, 2, 4], 2
        args.experts, args.top_k, args.moe_intermediate, args.head_dim = 8, 2, 32, 16
        if args.family == "qwen3_moe" and args.compare_expert_rank >= 0:
            args.compare_expert_rank = 1

    install_temper_shim()
    if args.dry_run:
        print(json.dumps(dry_run(args), default=str), flush=True)
        return 0
    import torch
    import transformers

    from temper.services.lora.model import ATTN_MODULES, MLP_MODULES, AdapterSpec, LoraModel

    started = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("CUDA requested but torch.cuda.is_available() is False")

    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    moe = args.family == "qwen3_moe"
    lora = LoraModel(model, f"random-{args.family}", args.lora_math)
    adapter_targets = lora.group_targets(attn=True, mlp=True) if moe else ATTN_MODULES + MLP_MODULES
    keys = [f"tenant-{i}" for i in range(max(args.tenants, *args.scaling))]
    for i, key in enumerate(keys):
        lora.add(key, AdapterSpec(rank=args.rank, alpha=32.0, targets=adapter_targets, expert_rank=args.expert_rank), seed=i)
    spec = lora.adapters[keys[0]].spec  # resolved: the routed experts' rank filled in
    print(f"model: {params / 1e9:.3f}B params ({args.family}, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}"
          + (f", {args.experts} experts top-{args.top_k}, expert rank {spec.expert_rank}" if moe else "")
          + f") on {args.device} {args.dtype}; {args.tenants} adapters rank {args.rank}; built in "
          f"{time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)

    g = torch.Generator().manual_seed(0)
    n_rows = args.tenants * args.rows
    all_rows = max(args.tenants, *args.scaling) * args.rows
    tokens = torch.randint(0, args.vocab, (all_rows, args.tokens + 1), generator=g).to(device)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    tenant_rows = [torch.arange(i * args.rows, (i + 1) * args.rows, device=device) for i in range(len(keys))]
    local_rows = torch.arange(args.rows, device=device)

    def zero_grads():
        for adapter in lora.adapters.values():
            for p in adapter.params.values():
                p.grad = None

    def run_cobatched(k: int = args.tenants):
        rows = k * args.rows
        forward_backward(lora, ids[:rows], targets[:rows], list(zip(keys[:k], tenant_rows[:k])), args.chunk)

    def run_time_sliced():
        for key, rows in zip(keys[:args.tenants], tenant_rows):
            forward_backward(lora, ids.index_select(0, rows), targets.index_select(0, rows), [(key, local_rows)], args.chunk)

    def run_single():
        forward_backward(lora, ids[:n_rows], targets[:n_rows], [(keys[0], torch.arange(n_rows, device=device))], args.chunk)

    fns = {"cobatched": run_cobatched, "time_sliced": run_time_sliced, "single_adapter": run_single}
    variants = list(fns)
    peak_bytes = {v: 0 for v in variants}

    def timed(name: str) -> float:
        zero_grads()  # gradient accumulation is not what is measured; keep every pass alike
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fns[name]()
        if cuda:
            torch.cuda.synchronize()
            peak_bytes[name] = max(peak_bytes[name], torch.cuda.max_memory_allocated())
        return time.perf_counter() - start

    def timed_fn(fn) -> float:
        zero_grads()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        for name in variants:
            timed(name)
    samples = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for name in order:
            samples[name].append(timed(name))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {samples[n][-1] * 1e3:.1f} ms" for n in variants),
              file=sys.stderr, flush=True)

    med = {n: report.median(xs) for n, xs in samples.items()}
    paired = report.cobatch_ratios(samples["cobatched"], samples["single_adapter"], samples["time_sliced"])[0]
    ratios = {n: paired[n] for n in GOALS}
    met = {n: report.goal_met(GOALS[n], v) for n, v in ratios.items()}
    total_tokens = n_rows * args.tokens

    # MFU of each variant on the convention of the module docstring
    flops = flops_per_token(model, lora, spec)
    gpu_name = torch.cuda.get_device_name(device) if cuda else None
    peak = peak_flops(args, gpu_name)
    mfu = {n: (flops["total"] * total_tokens / m / peak if peak else None) for n, m in med.items()}
    print("mfu: " + ", ".join(f"{n} {v:.3f}" if v is not None else f"{n} n/a" for n, v in mfu.items()), file=sys.stderr, flush=True)

    # scaling curve: one co-batched pass of k tenants, interleaved, tokens/s relative to k = 1
    scaling_samples = {k: [] for k in args.scaling}
    for k in args.scaling:
        timed_fn(lambda: run_cobatched(k))  # warm-up of this shape
    for rep in range(args.scaling_reps):
        order = args.scaling[rep % len(args.scaling):] + args.scaling[: rep % len(args.scaling)]
        for k in order:
            scaling_samples[k].append(timed_fn(lambda: run_cobatched(k)))
    scaling_tps = {k: k * args.rows * args.tokens / statistics.median(xs) for k, xs in scaling_samples.items()}
    base_k = args.scaling[0]
    scaling = {"tenants": args.scaling, "tokens_per_s": {str(k): v for k, v in scaling_tps.items()},
               "relative_to_first": {str(k): v / scaling_tps[base_k] for k, v in scaling_tps.items()},
               "mfu": {str(k): (flops["total"] * v / peak if peak else None) for k, v in scaling_tps.items()},
               "samples_s": {str(k): xs for k, xs in scaling_samples.items()}}
    print("scaling (tokens/s relative to 1 tenant): " + ", ".join(f"{k}: {v:.2f}" for k, v in scaling["relative_to_first"].items()),
          file=sys.stderr, flush=True)

    # LoRA math in the activation dtype against float32: gradients of one co-batched pass
    lora_math = None
    if args.dtype != "float32":
        grads = {}
        for math_dtype in ("activation", "float32"):
            lora.router.math_dtype = math_dtype
            zero_grads()
            run_cobatched()
            grads[math_dtype] = grad_vectors(lora, keys[:args.tenants])
        lora.router.math_dtype = args.lora_math
        lora_math = {"max_relative_grad_error": max_relative_error(grads["activation"], grads["float32"])}
        print(f"lora math {args.dtype} vs float32: max relative gradient error {lora_math['max_relative_grad_error']:.2e}",
              file=sys.stderr, flush=True)

    # ragged tenants (1..3 rows): grouped_mm against padded batched matmuls
    from temper.services.lora import grouped_matmul

    ragged_sizes = [1 + i % 3 for i in range(args.tenants)]
    starts = [sum(ragged_sizes[:i]) for i in range(args.tenants)]
    ragged_routing = [(keys[i], torch.arange(starts[i], starts[i] + n, device=device)) for i, n in enumerate(ragged_sizes)]
    ragged_rows = sum(ragged_sizes)
    ragged_ids = tokens[:ragged_rows, :-1].contiguous() if ragged_rows <= all_rows else None

    def ragged_check(ragged_ids, ragged_rows, ragged_routing) -> dict:
        """grouped_mm (CUDA bf16) against padded batched matmuls on tenants of 1..3 rows."""
        ragged_targets = tokens[:ragged_rows, 1:].contiguous()
        grouped, ragged_grads = {"rows_per_tenant": ragged_sizes, "seconds": {}}, {}
        saved = dict(grouped_matmul.SETTINGS)
        for name, on in (("grouped_mm", True), ("padded_bmm", False)):
            grouped_matmul.SETTINGS.update(enabled=on and saved["enabled"])
            run = lambda: forward_backward(lora, ragged_ids, ragged_targets, ragged_routing, args.chunk)  # noqa: E731
            timed_fn(run)
            grouped["seconds"][name] = float(statistics.median([timed_fn(run) for _ in range(max(2, args.reps // 2))]))
            zero_grads()
            run()
            ragged_grads[name] = grad_vectors(lora, keys[:args.tenants])
        grouped_matmul.SETTINGS.update(saved)
        # dense LoRA runs grouped_mm on CUDA bf16 only (the CPU smoke compares padded with padded there)
        grouped["grouped_mm_used"] = bool(saved["enabled"] and cuda and args.dtype == "bfloat16"
                                          and not grouped_matmul.FAILED)
        grouped["max_relative_grad_error"] = max_relative_error(ragged_grads["grouped_mm"], ragged_grads["padded_bmm"])
        grouped["speedup"] = grouped["seconds"]["padded_bmm"] / grouped["seconds"]["grouped_mm"]
        print(f"ragged tenants: grouped_mm {grouped['seconds']['grouped_mm'] * 1e3:.1f} ms, padded bmm "
              f"{grouped['seconds']['padded_bmm'] * 1e3:.1f} ms (used: {grouped['grouped_mm_used']}), max relative "
              f"gradient error {grouped['max_relative_grad_error']:.2e}", file=sys.stderr, flush=True)
        return grouped

    expert_rank_check = None
    if moe and args.compare_expert_rank >= 0:
        # a second set of adapters whose routed experts have another rank: one co-batched pass, timed like the main one
        other = [f"other-{i}" for i in range(args.tenants)]
        for i, key in enumerate(other):
            other_spec = AdapterSpec(rank=args.rank, alpha=32.0, targets=adapter_targets, expert_rank=args.compare_expert_rank)
            lora.add(key, other_spec, seed=i)
        other_rank = lora.adapters[other[0]].spec.expert_rank
        run_other = lambda: forward_backward(lora, ids[:n_rows], targets[:n_rows], list(zip(other, tenant_rows)),  # noqa: E731
                                             args.chunk)
        # a warm-up pass (the new adapters' one-off costs) and one timed pass: where the expert rank misses
        # grouped_mm's alignment the pass may be many times slower than the main one
        timed_fn(run_other)
        seconds = timed_fn(run_other)
        expert_rank_check = {"expert_rank": other_rank, "seconds": seconds, "main_expert_rank": spec.expert_rank,
                             "main_cobatched_seconds": med["cobatched"], "slowdown": seconds / med["cobatched"],
                             "grouped_mm_shapes_ok": {str(r): (r * 2) % 16 == 0 for r in (other_rank, spec.expert_rank)}}
        for key in other:
            lora.remove(key)
        print(f"expert rank {other_rank}: co-batched pass {seconds * 1e3:.1f} ms vs {med['cobatched'] * 1e3:.1f} ms at expert "
              f"rank {spec.expert_rank} ({expert_rank_check['slowdown']:.2f}x)", file=sys.stderr, flush=True)

    grouped = None
    try:
        grouped = ragged_check(ragged_ids, ragged_rows, ragged_routing) if ragged_ids is not None else None
    except Exception as exc:  # noqa: BLE001 - a kernel refusing must not cost the run's other figures
        grouped_matmul.SETTINGS.update(enabled=hasattr(torch.nn.functional, "grouped_mm"))
        grouped = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(f"ragged tenants: {grouped['error']}", file=sys.stderr, flush=True)

    result = {
        "benchmark": "gpu_multitenant",
        "smoke": args.smoke,
        "ratios": ratios,
        "goals": {n: f"{op} {g}" for n, (op, g) in GOALS.items()},
        "goal_met": met,
        "medians_s": med,
        "samples_s": samples,
        "tokens_per_s": {n: total_tokens / m for n, m in med.items()},
        "mfu": mfu,
        "flops_per_token": flops,
        "flops_convention": "6 N T for the frozen base (N: every matmul's parameters, decoder linears + lm_head, no "
                            "embedding) + 6 r (in + out) T per adapted linear; attention T^2 terms not counted",
        "peak_flops": peak,
        "scaling": scaling,
        "lora_math": lora_math,
        "grouped_ragged": grouped,
        "expert_rank_check": expert_rank_check,
        "peak_cuda_mib": {n: b / 2**20 for n, b in peak_bytes.items()} if cuda else None,
        "config": {
            "device": args.device, "gpu": gpu_name, "dtype": args.dtype,
            "params": params, "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
            "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "tenants": args.tenants,
            "rows_per_tenant": args.rows, "tokens_per_row": args.tokens, "rank": args.rank, "targets": "attn+mlp",
            "family": args.family, "target_modules": list(spec.targets),
            "moe": {"experts": args.experts, "top_k": args.top_k, "moe_intermediate": args.moe_intermediate,
                    "head_dim": args.head_dim or args.hidden // args.heads, "expert_rank": spec.expert_rank,
                    "active_params": flops["base_matmul_params"]} if moe else None,
            "lm_head_chunk_tokens": args.chunk, "warmup": args.warmup, "reps": args.reps, "torch": torch.__version__,
            "lora_math": args.lora_math, "stacking_scope": "per pass (LoraModel.stacking)",
            "grouped_mm_available": hasattr(torch.nn.functional, "grouped_mm"),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "lora_module": sys.modules["temper.services.lora.model"].__file__,
            "numerics_module": sys.modules["temper.services.trainer.numerics"].__file__,
        },
        "total_seconds": time.perf_counter() - started,
    }
    report.print_ratios(ratios, GOALS, met, width=18)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
