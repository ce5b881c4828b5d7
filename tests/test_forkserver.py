"""On the CPU the launcher's processes fork from a forkserver that has already done their imports
(launch/forkserver.py); a SIGKILLed launcher's forkserver and processes: tests/test_train_e2e.py."""
import json
import os
import sys

from launch.forkserver import PRELOAD, context
from launch.supervisor import Supervisor


def _report(path: str) -> None:
    with open(path, "w") as f:
        json.dump({"preloaded": [m for m in PRELOAD if m in sys.modules], "late": os.environ.get("RINGRL_TEST_LATE"),
                   "environ": dict(os.environ)}, f)


def test_a_child_starts_with_the_imports_done_and_the_launcher_s_environment_of_that_moment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the forkserver must find ringrl's modules all the same
    ctx = context("cpu")  # the forkserver starts now, before the launcher sets the variable below
    monkeypatch.setenv("RINGRL_TEST_LATE", "set after the forkserver started")
    sup = Supervisor(ctx=ctx)
    try:
        sup.start("rollout-0", _report, dict(path=str(tmp_path / "seen.json")), threads=1, essential=True)
        assert sup.watch() is None
    finally:
        sup.shutdown()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["preloaded"] == list(PRELOAD)  # imported by the forkserver: this test module imports none of them
    assert seen["late"] == "set after the forkserver started"
    assert seen["environ"] == dict(os.environ)  # not the forkserver's own (its PYTHONPATH, its launcher's pid)


def test_with_cuda_the_processes_are_spawned():
    assert context("gpu").get_start_method() == "spawn"
