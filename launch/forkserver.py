"""How the launcher starts its processes on the CPU: forked from a server that has already imported torch,
transformers and ringrl's worker modules.

With `spawn`, every rollout worker and trainer rank imports torch and transformers itself: 3-8 s each on a
2-core CPU, two at a time, after the launcher's own set-up. The forkserver does those imports once, while the
launcher sets up, so a child starts with them done. Each child still receives its arguments pickled, as under
`spawn`, and runs `launch/supervisor.py`'s `_child_main`, which first takes the launcher's environment as it
is at that start.

With CUDA the launcher keeps `spawn`: a child forked from a process that has touched the CUDA driver cannot
use it, and importing transformers may touch it.

Process tree: launcher -> forkserver -> children. The forkserver dies with the launcher (PR_SET_PDEATHSIG,
set when it imports this module), and each child with the forkserver (`_child_main`), so a killed launcher
still leaves nothing behind.
"""
import ctypes
import multiprocessing as mp
import os
import signal
import time
from multiprocessing import forkserver

from launch.memory import children, stat_fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What every rollout worker and trainer rank imports. The rest of a model family's code (modeling_qwen2, ...)
# is small once these are in.
PRELOAD = ("rollout", "trainer.loop", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama")
# set only in the environment the forkserver starts with: its parent's pid
_LAUNCHER = "RINGRL_FORKSERVER_LAUNCHER"
# in the launcher: the processes `context` started (the forkserver, a resource tracker)
_STARTED: set[int] = set()


def context(device_type: str):
    """The multiprocessing context for the launcher's processes: on the CPU, a forkserver started now (its
    imports run beside the launcher's set-up), else `spawn`."""
    if device_type != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *PRELOAD])
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", _LAUNCHER)}
    # The forkserver is a fresh `python -c`: before Python 3.13 it does not take the launcher's sys.path, so
    # ringrl's modules would not import there. Its children take the launcher's environment back
    # (_child_main).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, saved["PYTHONPATH"]) if p)
    os.environ[_LAUNCHER] = str(os.getpid())
    try:
        before = set(children(os.getpid()))
        forkserver.ensure_running()  # the resource tracker too, when it is not running yet
        _STARTED.update(set(children(os.getpid())) - before)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def wait_for_imports(quiet_s: float = 0.05, timeout_s: float = 120.0) -> None:
    """Return once the forkserver has done its imports: its CPU time stands still for `quiet_s`. The launcher
    measures its matmul peak after this, so that it has the cores to itself; no process can start from the
    forkserver sooner anyway. The imports are usually done by then, but not on a fresh checkout, where the
    forkserver also compiles every module."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        ticks = sum(_cpu_ticks(pid) for pid in _STARTED)
        if ticks == last:
            return
        last = ticks
        time.sleep(quiet_s)


def _cpu_ticks(pid: int) -> int:
    """User and system CPU time of `pid` in clock ticks (0 once it is gone)."""
    fields = stat_fields(pid)
    try:
        return int(fields[11]) + int(fields[12]) if fields else 0
    except (IndexError, ValueError):
        return 0


def _die_with(launcher: int) -> None:
    """Linux: the kernel kills this process when the launcher, its parent, dies, even by SIGKILL; if the
    launcher is already gone, exit now."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != launcher:
        os._exit(1)


# this is the forkserver, importing its preload (a launcher that failed at once is gone)
if _LAUNCHER in os.environ:
    _die_with(int(os.environ[_LAUNCHER]))
