#!/usr/bin/env bash
# The test suite as CI runs it, on a machine of another speed than this one (README, "Testing"):
#   bash scripts/ci_stress.sh one-core          # every process pinned to core 0: a machine half as fast
#   bash scripts/ci_stress.sh hog               # a busy loop on every core beside the suite: a shared machine
#   bash scripts/ci_stress.sh hog tests/test_hang.py -x    # pytest's arguments after the mode
# A test that passes here and on an idle machine waits for states, not for time.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
[ $# -gt 0 ] && shift
case "$mode" in
  one-core)
    exec taskset -c 0 .venv/bin/python -m pytest -q "$@" ;;
  hog)
    hogs=()
    for _ in $(seq "$(nproc)"); do
      python3 -c 'while True: pass' &
      hogs+=($!)
    done
    trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
    .venv/bin/python -m pytest -q "$@" ;;
  *)
    echo "usage: bash scripts/ci_stress.sh one-core|hog [pytest arguments]" >&2
    exit 2 ;;
esac
