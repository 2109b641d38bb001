#!/usr/bin/env bash
# Co-batched vs time-sliced multi-tenant LoRA training on a CUDA machine (bf16): a random ~1.1B Llama and a
# random Qwen3-30B-A3B-shaped mixture of experts (GPU_BENCH=dense|moe|all).
#
# Needs only torch + transformers + safetensors (no grpc/protobuf/pydantic, no weights, no internet):
# benchmarks/gpu_multitenant.py imports the repo's services/lora through a small import shim.
# Usage (from anywhere):  benchmarks/gpu_multitenant.sh [extra gpu_multitenant.py args]
# The JSON lands in $OUT (the device runner's output folder) if set, else benchmarks/results/
# (gpu_multitenant.json, gpu_multitenant_moe.json).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
RESULTS="${OUT:-$HERE/results}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"   # not needed for temper.* (the shim does that); harmless

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || echo "nvidia-smi not available"
"$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'

# Which configs: GPU_BENCH=dense (the Llama below), moe (the Qwen3-30B-A3B-shaped one), all (default: dense, then moe).
GPU_BENCH="${GPU_BENCH:-all}"

if [[ "$GPU_BENCH" == "all" || "$GPU_BENCH" == "dense" ]]; then
# ~1.1B params (TinyLlama shape: hidden 2048, 22 layers, 32 heads / 4 kv heads, vocab 32000),
# 16 tenants x 2 datums x 256 tokens, rank-16 adapters on attn+mlp. Reports cobatch_gain, cobatch_overhead,
# MFU (6 N T + LoRA terms, see the script's docstring), the 1/2/4/8/16-tenant scaling curve, bf16 vs fp32
# LoRA-math gradient error and grouped_mm vs padded bmm on ragged tenants. Budget: well under 5 minutes.
timeout 290 "$PYTHON" benchmarks/gpu_multitenant.py \
  --device cuda --dtype bfloat16 \
  --tenants 16 --rows 2 --tokens 256 --rank 16 \
  --hidden 2048 --intermediate 5632 --layers 22 --heads 32 --kv-heads 4 --vocab 32000 \
  --warmup 3 --reps 10 \
  --json-out "$RESULTS/gpu_multitenant.json" "$@"
fi

if [[ "$GPU_BENCH" == "all" || "$GPU_BENCH" == "moe" ]]; then
# Random Qwen3-30B-A3B shape (30.5B params, ~3.3B active): 48 layers, hidden 2048, 32 heads / 4 kv heads,
# head_dim 128, 128 routed experts top-8, moe_intermediate 768, vocab 151936, bf16. Adapters: rank 16 on
# attention + routed experts; expert rank 8 (the trainer's default would be 16 // 8 = 2, and grouped_mm needs
# a multiple of 8 in bf16, else services/lora/experts.py pads (expert, adapter) slices for batched matmuls:
# --compare-expert-rank 0 times a co-batched pass at that default next to the main one).
# 16 tenants x 1 datum x 256 tokens (4096 tokens a co-batched pass): weights ~57 GiB + activations ~32 GiB
# stored (no checkpointing), well inside one H200 (at 2 datums per tenant the estimate is ~120 GiB: too
# close). Check the fit without a GPU: add --dry-run. Reports cobatch_gain, cobatch_overhead and MFU on
# the active parameters (attention, routers, lm_head and top-8 experts per token + the LoRA terms).
# Budget: ~5 minutes (the 16 time-sliced passes are kernel-launch bound: 128 experts x 48 layers).
timeout 420 "$PYTHON" benchmarks/gpu_multitenant.py \
  --family qwen3_moe --device cuda --dtype bfloat16 \
  --tenants 16 --rows 1 --tokens 256 --rank 16 --expert-rank 8 --compare-expert-rank 0 \
  --hidden 2048 --intermediate 6144 --layers 48 --heads 32 --kv-heads 4 --head-dim 128 --vocab 151936 \
  --experts 128 --top-k 8 --moe-intermediate 768 \
  --warmup 1 --reps 4 --scaling 1 4 16 --scaling-reps 2 \
  --json-out "$RESULTS/gpu_multitenant_moe.json" "$@"
fi
