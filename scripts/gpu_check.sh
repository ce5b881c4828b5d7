#!/usr/bin/env bash
# The GPU check, for a borrowed machine with a CUDA GPU whose Python has torch and transformers (no network
# needed): the gpu-marked tests, train.py on the one-GPU plan with the built-in engine (full, at max_staleness 0,
# LoRA), and the GPU benchmarks with random models of real architectures, in parts that each fit a 10-minute
# command and each leave a small report in $OUT (scripts/gpu_check.py has the details; docs/gpu.md the how-to).
#   bash scripts/gpu_check.sh --part 1|2|3   # one part (a GPU machine: one part per command)
#   bash scripts/gpu_check.sh --cpu          # every part on the CPU with a tiny model (the GPU plan's classes)
# It runs $PYTHON, else the `python` (or `python3`) first on PATH (such a machine has no .venv). What that
# Python lacks comes from wheels/, made here by `bash scripts/gpu_wheels.sh` and carried with the working tree
# (wheels/ is git-ignored: name it in what travels).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$(command -v python || command -v python3)}
exec "$py" -m scripts.gpu_check "$@"
