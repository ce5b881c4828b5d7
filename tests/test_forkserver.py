"""On the CPU the launcher's processes fork from a forkserver that has already done their imports
(launch/forkserver.py); a SIGKILLed launcher's forkserver and processes: tests/test_train_e2e.py."""
import json
import os
import sys

from launch.forkserver import PRELOAD, context
from launch.supervisor import Supervisor


def _report(path: str) -> None:
    with open(path, "w") as f:
        json.dump({"preloaded": [m for m in PRELOAD if m in sys.modules],
                   "late": os.environ.get("RINGRL_TEST_LATE"), "environ": dict(os.environ)}, f)


def test_a_child_starts_with_the_imports_done_and_the_launcher_s_environment_of_that_moment(tmp_path,
                                                                                            monkeypatch):
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
    # imported by the forkserver: this test module imports none of them
    assert seen["preloaded"] == list(PRELOAD)
    assert seen["late"] == "set after the forkserver started"
    # not the forkserver's own (its PYTHONPATH, its launcher's pid)
    assert seen["environ"] == dict(os.environ)


def test_with_cuda_the_processes_are_spawned():
    assert context("gpu").get_start_method() == "spawn"



SPIN = """
import os, time
end = time.process_time() + 1.0  # a second of CPU: imports that take a while, as a fresh checkout's
while time.process_time() < end:
    pass
open(os.environ["RINGRL_TEST_SPUN"], "w").close()
"""

WAIT = """
import os, sys
sys.path.insert(0, {root!r})
import launch.forkserver as forkserver
forkserver.PRELOAD = ("spin_preload",)
forkserver.context("cpu")
forkserver.wait_for_imports()
print("imports done when the wait returned:", os.path.exists(os.environ["RINGRL_TEST_SPUN"]))
"""


def test_the_launcher_waits_for_the_forkserver_s_imports(tmp_path):
    import subprocess

    from tests.helpers import ROOT, die_with_parent

    (tmp_path / "spin_preload.py").write_text(SPIN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RINGRL_TEST_SPUN": str(tmp_path / "spun")}
    out = subprocess.run([sys.executable, "-c", WAIT.format(root=ROOT)], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=120, preexec_fn=die_with_parent)
    assert "imports done when the wait returned: True" in out.stdout, out.stdout + out.stderr[-2000:]


PEAK_WATCH = """
import multiprocessing, os, runpy, sys
sys.path.insert(0, {root!r})
import launch.forkserver
import trainer.peak

waited = []
launch.forkserver.wait_for_imports = lambda: waited.append(True)
# the launcher's context, without a forkserver importing beside this short test
launch.forkserver.context = lambda device: multiprocessing.get_context("forkserver" if device == "cpu" else "spawn")

def watched(*args):
    print("waited for the forkserver before measuring the peak:", waited == [True], flush=True)
    os._exit(0)

trainer.peak.learner_peak = watched
sys.argv = [os.path.join({root!r}, "train.py"), *{args!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
"""  # noqa: E501


def test_the_launcher_measures_its_matmul_peak_once_the_forkserver_is_done(tmp_path, tiny_model_dir):
    """perf/learner_mfu divides by the launcher's peak: measured while the forkserver imported on the other
    core (on a fresh checkout it also compiles every module), the peak read low and the utilisation
    above 1."""
    import subprocess

    from tests.helpers import ROOT, TINY, die_with_parent

    args = [f"hydra.run.dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "progress=false", *TINY]
    out = subprocess.run([sys.executable, "-c", PEAK_WATCH.format(root=ROOT, args=args)], cwd=ROOT, text=True,
                         capture_output=True, timeout=120, preexec_fn=die_with_parent)
    assert "waited for the forkserver before measuring the peak: True" in out.stdout, \
        out.stdout + out.stderr[-2000:]
