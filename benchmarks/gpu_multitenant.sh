#!/usr/bin/env bash
# Co-batched vs time-sliced multi-tenant LoRA training on a CUDA machine (bf16, random ~1.1B Llama).
#
# Needs only torch + transformers + safetensors (no grpc/protobuf/pydantic, no weights, no internet):
# benchmarks/gpu_multitenant.py imports the repo's services/lora through a small import shim.
# Usage (from anywhere):  benchmarks/gpu_multitenant.sh [extra gpu_multitenant.py args]
# The JSON lands in $OUT (the device runner's output folder) if set, else benchmarks/results/.
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
