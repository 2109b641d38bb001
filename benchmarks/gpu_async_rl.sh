#!/usr/bin/env bash
# Asynchronous vs synchronous RL on a CUDA machine: benchmarks/async_rl.py with the trainer and the sampler
# of its local stack on the GPU (--device cuda; both share the one card). Same recipe, figures and goals as
# the CPU run (steps/hour async/sync >= 1.25 at equal held-out reward; save-to-first-token / training step
# <= 0.05; prefix-cache hit rate); SmolLM2-135M-Instruct, float32 unless DTYPE is set.
#
# Runs the real services, so it needs the repo's server extra on the GPU machine (`pip install -e '.[server]'`
# with its own CUDA torch) and SmolLM2 in the Hugging Face cache (the machine has no network).
# Without CUDA it runs the CPU --quick smoke instead (MODEL= a local model folder), so the script is checkable anywhere.
# Usage: benchmarks/gpu_async_rl.sh [extra async_rl.py args]. JSON/PNG: $OUT/async_rl_cuda.* if OUT is set, else benchmarks/results/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
RESULTS="${OUT:-$HERE/results}"
DTYPE="${DTYPE:-float32}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || echo "nvidia-smi not available"
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  timeout 540 "$PYTHON" benchmarks/async_rl.py --device cuda --dtype "$DTYPE" --threads 4 --steps 12 \
    --out-dir "$RESULTS" "$@"
else
  echo "no CUDA device: the CPU --quick smoke run instead" >&2
  timeout 540 "$PYTHON" benchmarks/async_rl.py --quick ${MODEL:+--model "$MODEL"} --out-dir "$RESULTS" "$@"
fi
