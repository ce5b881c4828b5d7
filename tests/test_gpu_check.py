"""`bash scripts/gpu_check.sh --cpu`: the GPU check's own dry run, so the script keeps working where CI runs."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow  # a long end-to-end run: CI's suite must stay under 15 minutes on 2 cores
def test_gpu_check_dry_run_on_the_cpu_passes_and_writes_its_report(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])  # its `python`
    env.pop("OUT", None)
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and report["mode"] == "cpu"
    assert report["machine"]["torch"] and report["machine"]["commit"] != "unknown"
    names = [s["name"] for s in report["steps"]]
    assert names[:3] == ["tests", "train", "train_lora"] and {f"bench/tiny/{b}" for b in ("gpu_engine", "gpu_train",
                                                                         "gpu_weights")} <= set(names)
    train = next(s for s in report["steps"] if s["name"] == "train")
    assert train["steps"] == 3 and train["gen_tokens_per_s"] > 0
    for s in report["steps"]:
        if s["name"].startswith("bench/"):
            assert "=" in s["result"] and s["figures"], s
    assert "passed" in (tmp_path / "report.md").read_text().splitlines()[0]


def test_gpu_check_fails_when_a_step_fails(tmp_path, monkeypatch):
    """A failing step makes the report say so and the exit code non-zero (here: a benchmark that cannot run)."""
    import scripts.gpu_check as check

    monkeypatch.setattr(check, "BENCHMARKS", ("no_such_benchmark",))
    monkeypatch.setattr(check, "run_gpu_tests", lambda out, env: {"summary": "skipped here"})
    monkeypatch.setattr(check, "run_train", lambda *args: {"steps": 0})
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--cpu", "--out", str(tmp_path)])
    assert check.main() == 1
    report = json.loads((tmp_path / "report.json").read_text())
    failed = [s["name"] for s in report["steps"] if not s["ok"]]
    assert failed == ["bench/tiny/no_such_benchmark"] and not report["ok"]
    assert "FAILED" in (tmp_path / "report.md").read_text().splitlines()[0]
