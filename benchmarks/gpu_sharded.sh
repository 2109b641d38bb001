#!/usr/bin/env bash
# Model sharding (issue 20) on GPUs: the GPU variant of benchmarks/sharded.py (one process holding the whole
# base model against 2 ranks sharding it with FSDP2), for a machine with >= 2 CUDA devices, one rank per GPU.
#
# Usage (from anywhere):  benchmarks/gpu_sharded.sh
# Exit status: 0 with fewer than 2 GPUs (says so, measures nothing: no number is made up from one GPU);
# 2 with 2+ GPUs, because benchmarks/sharded.py has no CUDA/NCCL path yet (see below).
#
# Why no GPU run yet: benchmarks/sharded.py is CPU-only by construction, not by a flag: its ranks join a gloo
# group, run every pass on torch.device("cpu"), and its memory numbers are host RSS sampled from
# /proc/self/statm (the GPU measure would be torch.cuda.max_memory_allocated per rank). A GPU variant needs
# --device cuda (rank r on cuda:r, backend "cpu:gloo,cuda:nccl" as services/trainer/group.py's join uses),
# the model moved to the rank's device before sharding, CUDA peak memory instead of RSS, and bf16. Until
# sharded.py has those, this script reports the device count and stops rather than run the CPU benchmark
# and present it as a GPU one. The trainer itself runs a group on CUDA (group.join: NCCL for the
# tensors, gloo for the control messages); that path is what the benchmark should measure.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
PYTHON="${PYTHON:-python3}"

count=0
if command -v nvidia-smi >/dev/null 2>&1; then
  count="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
fi
if [[ "$count" -eq 0 ]]; then  # no nvidia-smi (or it failed): ask torch
  count="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
fi
echo "gpu_sharded: ${count} CUDA device(s) visible"

if [[ "$count" -lt 2 ]]; then
  echo "gpu_sharded: needs >= 2 GPUs (one rank per GPU); this machine has ${count}: nothing measured"
  exit 0
fi

if ! grep -q -- '--device' benchmarks/sharded.py; then
  echo "gpu_sharded: benchmarks/sharded.py has no --device/NCCL path yet (it is a CPU/gloo benchmark);"
  echo "gpu_sharded: not running it on ${count} GPUs as if it measured them (see this script's header)"
  exit 2
fi

export PYTHONUNBUFFERED=1
RESULTS="${OUT:-$HERE/results}"
mkdir -p "$RESULTS"
timeout 590 "$PYTHON" benchmarks/sharded.py --device cuda --out "$RESULTS" "$@"
