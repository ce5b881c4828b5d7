"""Every call ringrl makes into SGLang, checked against the installed sglang's source by
scripts/sglang_calls.py (it parses the source, never imports it: sglang's imports want CUDA). Skipped where
sglang is not installed, as in CI; where it is, a version that moved one of these names fails here, with the
name, before any GPU job does. `python -m scripts.sglang_calls` checks the pinned version without installing
it (pip download --no-deps).

    pytest tests/test_sglang_contract.py          # after pip install -r requirements-gpu.txt
"""
import importlib.util
import os

import pytest

from scripts.sglang_calls import check_all

spec = importlib.util.find_spec("sglang")
pytestmark = pytest.mark.skipif(spec is None, reason="sglang is not installed (requirements-gpu.txt)")


def test_every_call_ringrl_makes_exists_in_the_installed_sglang():
    lines = check_all(os.path.dirname(spec.origin))
    bad = [line for ok, line in lines if not ok]
    assert lines and not bad, "\n".join(bad)
