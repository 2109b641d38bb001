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

    python benchmarks/gpu_multitenant.py --device cuda --dtype bfloat16     # ~1.1B params, 16 tenants
    python benchmarks/gpu_multitenant.py --smoke                            # tiny config on CPU, seconds

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


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max(2048, args.tokens),
        tie_word_embeddings=False,
    )
    dtype = getattr(torch, args.dtype)
    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # build directly in the target dtype and on the device (fast, no fp32 copy)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def forward_backward(lora, ids, targets, routing, chunk: int):
    """One training pass as the trainer runs it (cross-entropy, weights 1, no padding)."""
    import torch

    from temper.services.trainer.numerics import target_logprobs_pass

    mask = torch.ones_like(ids, dtype=torch.bool)
    lp = target_logprobs_pass(lora, ids, mask, targets.unsqueeze(-1), routing, chunk)
    loss = -lp.sum()
    loss.backward()
    return lp.detach().cpu()  # the engine copies every row's logprobs back to the host: one sync per pass


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
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per lm_head/log-softmax chunk")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU in float32: checks the script runs")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.tenants, args.rows, args.tokens, args.rank = 4, 2, 32, 4
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab = 64, 128, 2, 4, 2, 512
        args.chunk, args.warmup, args.reps = 64, 1, 3

    install_temper_shim()
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
    lora = LoraModel(model, "random-llama")
    spec = AdapterSpec(rank=args.rank, alpha=32.0, targets=ATTN_MODULES + MLP_MODULES)
    keys = [f"tenant-{i}" for i in range(args.tenants)]
    for i, key in enumerate(keys):
        lora.add(key, spec, seed=i)
    print(f"model: {params / 1e9:.3f}B params ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}) on "
          f"{args.device} {args.dtype}; {args.tenants} adapters rank {args.rank}; built in {time.perf_counter() - started:.1f}s",
          file=sys.stderr, flush=True)

    g = torch.Generator().manual_seed(0)
    n_rows = args.tenants * args.rows
    tokens = torch.randint(0, args.vocab, (n_rows, args.tokens + 1), generator=g).to(device)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    tenant_rows = [torch.arange(i * args.rows, (i + 1) * args.rows, device=device) for i in range(args.tenants)]
    local_rows = torch.arange(args.rows, device=device)

    def zero_grads():
        for adapter in lora.adapters.values():
            for p in adapter.params.values():
                p.grad = None

    def run_cobatched():
        forward_backward(lora, ids, targets, list(zip(keys, tenant_rows)), args.chunk)

    def run_time_sliced():
        for key, rows in zip(keys, tenant_rows):
            forward_backward(lora, ids.index_select(0, rows), targets.index_select(0, rows), [(key, local_rows)], args.chunk)

    def run_single():
        forward_backward(lora, ids, targets, [(keys[0], torch.arange(n_rows, device=device))], args.chunk)

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

    med = {n: float(statistics.median(xs)) for n, xs in samples.items()}
    ratios = {"cobatch_gain": med["time_sliced"] / med["cobatched"], "cobatch_overhead": med["cobatched"] / med["single_adapter"]}
    met = {n: (v >= GOALS[n][1] if GOALS[n][0] == ">=" else v <= GOALS[n][1]) for n, v in ratios.items()}
    total_tokens = n_rows * args.tokens
    result = {
        "benchmark": "gpu_multitenant",
        "smoke": args.smoke,
        "ratios": ratios,
        "goals": {n: f"{op} {g}" for n, (op, g) in GOALS.items()},
        "goal_met": met,
        "medians_s": med,
        "samples_s": samples,
        "tokens_per_s": {n: total_tokens / m for n, m in med.items()},
        "peak_cuda_mib": {n: b / 2**20 for n, b in peak_bytes.items()} if cuda else None,
        "config": {
            "device": args.device, "gpu": torch.cuda.get_device_name(device) if cuda else None, "dtype": args.dtype,
            "params": params, "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
            "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "tenants": args.tenants,
            "rows_per_tenant": args.rows, "tokens_per_row": args.tokens, "rank": args.rank, "targets": "attn+mlp",
            "lm_head_chunk_tokens": args.chunk, "warmup": args.warmup, "reps": args.reps, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "lora_module": sys.modules["temper.services.lora.model"].__file__,
            "numerics_module": sys.modules["temper.services.trainer.numerics"].__file__,
        },
        "total_seconds": time.perf_counter() - started,
    }
    for name, value in ratios.items():
        op, goal = GOALS[name]
        print(f"{name:18s} {value:6.3f}  (goal {op} {goal:g}: {'met' if met[name] else 'MISSED'})", file=sys.stderr)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
