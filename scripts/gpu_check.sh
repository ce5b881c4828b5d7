#!/usr/bin/env bash
# The GPU check in one command, for a machine with a CUDA GPU whose Python has torch and transformers, no network
# needed: the gpu-marked tests, train.py on the one-GPU plan with the built-in engine, and the GPU benchmarks,
# with random models of real architectures. Writes report.json and report.md under the output folder and exits
# non-zero on any failure (scripts/gpu_check.py has the details).
#   bash scripts/gpu_check.sh [--out DIR]    # DIR: $OUT when set, else gpu_check_report/
#   bash scripts/gpu_check.sh --cpu          # the same script on the CPU with a tiny model (the test suite runs it)
# It runs the `python` first on PATH (such a machine has no .venv). What that Python lacks comes from wheels/,
# made here by `bash scripts/gpu_wheels.sh` and carried along with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m scripts.gpu_check "$@"
