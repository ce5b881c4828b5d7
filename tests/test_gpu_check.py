"""`bash scripts/gpu_check.sh`: a check that always brings back its report, within what a borrowed GPU machine
returns (8 files, 16 MiB each, 64 MiB together), whatever a step does: fail, hang past its cap, or get the
whole command killed. Its full dry run on the CPU (the GPU plan's classes, a tiny model) is `slow`."""
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, alive


def _report(out) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow  # about 6 minutes on 2 cores: CI's suite must stay under 15
def test_gpu_check_dry_run_on_the_cpu_passes_and_returns_only_what_fits(tmp_path):
    # its `python`
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("OUT", None)
    start = time.monotonic()
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu", "--out",
                             str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=660)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - start < 600  # one device command
    report = _report(tmp_path)
    assert report["ok"] and report["mode"] == "cpu" and report["machine"]["source_digest"]
    names = [s["name"] for s in report["steps"]]
    assert names == PART_1 + ["train_lora", "tests_plan"]
    train = {s["name"]: s for s in report["steps"] if s["name"].startswith("train")}
    assert train["train"]["plan"].startswith("gpu plan on the cpu")  # the GPU plan's classes, not cluster=cpu
    # gpu1's default
    assert train["train"]["max_staleness"] == 1 and train["train_eta0"]["max_staleness"] == 0
    assert all(t["steps"] == 3 and t["gen_tokens_per_s"] > 0 and t["publish_s"] > 0 for t in train.values())
    for s in report["steps"]:
        if s["name"].startswith("bench/"):
            assert "=" in s["result"] and s["figures"], s
    files = sorted(os.listdir(tmp_path))
    assert files == sorted(["report.json", "report.md", "logs.tar.gz", "train.metrics.jsonl",
                            "train_eta0.metrics.jsonl", "train_lora.metrics.jsonl"])
    sizes = [os.path.getsize(tmp_path / f) for f in files]
    assert max(sizes) <= 16 << 20 and sum(sizes) <= 64 << 20
    assert "passed" in (tmp_path / "report.md").read_text().splitlines()[0]


PART_1 = ["bench/tiny/gpu_engine", "bench/tiny/gpu_weights", "tests", "train", "train_eta0",
          "bench/tiny/gpu_train"]


@pytest.mark.slow  # about a minute on 2 cores
def test_part_1_runs_alone_within_its_budget_on_the_cpu(tmp_path):
    """The part a lent GPU machine runs first: the engine and the weight push before anything else,
    in 450 s."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("OUT", None)
    start = time.monotonic()
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu", "--part", "1",
                             "--out", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - start < 480
    report = _report(tmp_path)
    assert report["ok"] and report["budget_s"] == 450 and [s["name"] for s in report["steps"]] == PART_1
    engine = report["steps"][0]["figures"]
    assert engine["graphs_same_tokens_as_static"] == 1.0  # without CUDA the same eager step twice
    assert set(report["steps"][1]["figures"]["phases_median_s"]) >= {"gather", "pack", "hand-off", "acks"}


def _fake_parts(steps):
    """Patch the check's parts with these (name, function, cap) steps, as part 1."""
    import scripts.gpu_check as check

    return lambda cpu: {1: [check.Step(name, fn, cap) for name, fn, cap in steps]}


def _sleeper(check, timeout):
    """A step whose child (and the child's child) would run for ten minutes."""
    check.command("sleeper", ["bash", "-c", "sleep 600 & sleep 600"], timeout)


def test_a_failing_step_and_one_past_its_cap_are_named_and_the_part_goes_on(tmp_path, monkeypatch):
    import scripts.gpu_check as check

    def fails(c, timeout):
        c.command("fails", [sys.executable, "-c", "raise SystemExit('no GPU today')"], timeout)

    monkeypatch.setattr(check, "WORK", str(tmp_path / "work"))
    monkeypatch.setattr(check, "parts", _fake_parts([("fails", fails, 60), ("sleeper", _sleeper, 2),
                                                      ("quick", lambda c, t: {"figure": 1}, 60)]))
    monkeypatch.setattr(sys, "argv",
                        ["gpu_check", "--part", "1", "--out", str(tmp_path / "out"), "--budget", "200"])
    monkeypatch.setattr(check, "MARGIN_S", 0)
    monkeypatch.setattr(check, "MIN_STEP_S", 0)
    start = time.monotonic()
    assert check.main() == 1
    assert time.monotonic() - start < 60  # the sleeper was killed at its cap
    report = _report(tmp_path / "out")
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"fails": "failed", "sleeper": "timeout", "quick": "ok"} and report["ok"] is False
    fails_entry = next(s for s in report["steps"] if s["name"] == "fails")
    assert "no GPU today" in fails_entry["error"]
    assert "FAILED" in (tmp_path / "out" / "report.md").read_text().splitlines()[0]
    assert sorted(os.listdir(tmp_path / "out")) == ["logs.tar.gz", "report.json", "report.md"]


def _check_with_a_hanging_step(out: str, work: str) -> None:
    import scripts.gpu_check as check

    check.WORK = work
    check.parts = _fake_parts([("first", lambda c, t: {"figure": 1}, 60), ("hangs", _sleeper, 300),
                               ("never", lambda c, t: {}, 60)])
    sys.argv = ["gpu_check", "--part", "1", "--out", out, "--budget", "400"]
    check.main()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_check_killed_mid_step_leaves_a_report_that_names_the_step(tmp_path, sig):
    """The device's limit ends the command: whatever comes back says which step was running. SIGTERM also
    kills that step's process group; after SIGKILL its children are the machine's to reap."""
    out = tmp_path / "out"
    proc = mp.get_context("spawn").Process(target=_check_with_a_hanging_step,
                                           args=(str(out), str(tmp_path / "w")))
    proc.start()
    deadline = time.monotonic() + 120
    while not ((out / "report.json").exists() and any(
            s["name"] == "hangs" and s["status"] == "running" for s in _report(out)["steps"])):
        assert proc.is_alive() and time.monotonic() < deadline, "the check never reached its hanging step"
        time.sleep(0.05)
    sleepers = _sleepers(tmp_path / "w")
    os.kill(proc.pid, sig)
    proc.join(30)
    report = _report(out)  # valid JSON: it is replaced whole, never written in place
    entry = next(s for s in report["steps"] if s["name"] == "hangs")
    assert entry["status"] == ("running" if sig == signal.SIGKILL else "killed")
    assert report["ok"] is (None if sig == signal.SIGKILL else False)
    assert report["steps"][0]["status"] == "ok"
    assert "never" not in [s["name"] for s in report["steps"]]
    first_line = (out / "report.md").read_text().splitlines()[0]
    assert ("INCOMPLETE" if sig == signal.SIGKILL else "FAILED") in first_line
    if sig == signal.SIGTERM:
        assert _wait_gone(sleepers), "the step's process group outlived the check"
    for pid in sleepers:  # after SIGKILL: what the device would reap
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _sleepers(work) -> list[int]:
    """The hanging step's process group leader (its log names the command; the pid is found in /proc)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if f.read().startswith(b"bash\0-c\0sleep 600"):
                            found.append(int(entry))
                except OSError:
                    pass
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("the hanging step's process never started")


def _wait_gone(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def test_only_what_fits_the_return_limits_stays_in_out(tmp_path):
    from scripts.gpu_check import fit_return_limits

    (tmp_path / "report.json").write_text("{}")
    (tmp_path / "report.md").write_text("#")
    (tmp_path / "logs.tar.gz").write_bytes(b"x" * (17 << 20))  # over 16 MiB: dropped
    for i in range(8):
        (tmp_path / f"run{i}.metrics.jsonl").write_text("{}\n")
    kept = fit_return_limits(str(tmp_path))
    assert len(kept) == 8 and kept[:2] == ["report.json (2)", "report.md (1)"]
    assert sorted(os.listdir(tmp_path)) == sorted(k.split(" ")[0] for k in kept)
