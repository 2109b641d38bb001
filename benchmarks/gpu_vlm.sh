#!/usr/bin/env bash
# Vision-language co-batching on a CUDA machine (bf16): benchmarks/vlm.py on a larger random Qwen3-VL-MoE
# (text hidden 1024, 8 layers, 8 routed experts top-2, vocabulary 151,936 at Qwen3's ids; the tiny vision
# tower), 16 tenants x (one 128 x 128 image = 16 image tokens + 256 text tokens). Reports
# cobatch_overhead (goal <= 1.15) and cobatch_gain (goal >= 1.2); the memory ratio is the CPU run's.
#
# Unlike gpu_multitenant.sh this runs the trainer's real cycle path (convert + engine), so it needs the
# repo's server extra on the GPU machine: `pip install -e '.[server]'` with its own CUDA torch.
# Usage: benchmarks/gpu_vlm.sh [extra vlm.py args]. JSON: $OUT/vlm_cuda.json if OUT is set, else benchmarks/results/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
RESULTS="${OUT:-$HERE/results}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || echo "nvidia-smi not available"
timeout 290 "$PYTHON" benchmarks/vlm.py --device cuda --dtype bfloat16 --threads 4 \
  --hidden 1024 --layers 8 --vocab 151936 --tenants 16 --text-tokens 256 --image-size 128 --rank 16 \
  --reps 10 --out-dir "$RESULTS" "$@"
