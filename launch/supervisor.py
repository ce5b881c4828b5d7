"""Start worker processes with `spawn`, watch them, and shut everything down on any exit path."""
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait

import torch
from setproctitle import setproctitle

from buffer.shared import StopFlag
from launch.memory import tree_pss_mb


def _child_main(name, target, kwargs, errors, threads):
    _die_with_parent(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and tells us to stop
    torch.set_num_threads(threads)
    try:
        target(**kwargs)
    except BaseException:
        errors.put((name, traceback.format_exc()))
        sys.exit(1)


def _die_with_parent(name: str):
    """Linux: the kernel kills this process if the launcher dies, even by SIGKILL (no orphans). Also names it:
    `ps aux`, `top -c` and `pkill -f ringrl:rollout-0` see "ringrl:rollout-0"; `top` and `ps -o comm` (15
    characters at most) see "rollout-0"."""
    setproctitle(f"ringrl:{name}")
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, name.encode()[:15])  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)


class Supervisor:
    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.stop = StopFlag()
        self.errors = self.ctx.Queue()
        self.procs: dict[str, mp.Process] = {}
        self.essential: set[str] = set()  # processes whose clean exit means the run is done
        # Largest total memory of the launcher and all its processes. Reading it walks every process's page
        # tables (about 0.2 s for a SmolLM2 run's tree, 2 cores): sampled at most every second and so that it
        # takes no more than 1/20 of the launcher's time.
        self.peak_mb = 0.0
        self._next_sample = 0.0

    def start(self, name: str, target, kwargs: dict, threads: int, essential: bool = False) -> None:
        """Start `target(**kwargs)` in a new process; a name already used must belong to a dead process (a restart)."""
        if name in self.procs:
            assert self.procs[name].exitcode is not None, f"{name} is still running"
            self.procs[name].join()
        proc = self.ctx.Process(target=_child_main, args=(name, target, kwargs, self.errors, threads), name=name)
        proc.start()
        self.procs[name] = proc
        if essential:
            self.essential.add(name)

    def watch(self, on_failure=None) -> str | None:
        """Block until every essential process has exited cleanly (None), or a process fails and
        `on_failure(name, message)` does not start a replacement under the same name (the failure's message)."""
        finished: set[str] = set()
        while True:
            live = {p.sentinel: name for name, p in self.procs.items() if name not in finished}
            wait(list(live), timeout=1.0)
            self._sample_memory()
            for name, proc in list(self.procs.items()):
                if name in finished or proc.exitcode is None:
                    continue
                if proc.exitcode != 0:
                    message = self._describe(name, proc.exitcode)
                    if on_failure is not None and not self.stop.is_set() and on_failure(name, message):
                        continue
                    return message
                finished.add(name)
                if name not in self.essential:
                    return f"{name} exited before the run was done"
            if self.essential <= finished:
                return None

    def _sample_memory(self) -> None:
        now = time.monotonic()
        if now < self._next_sample:
            return
        self.peak_mb = max(self.peak_mb, tree_pss_mb())
        self._next_sample = now + max(1.0, 20 * (time.monotonic() - now))

    def _describe(self, name: str, exitcode: int) -> str:
        deadline = time.time() + 1.0
        while time.time() < deadline:
            try:
                who, trace = self.errors.get(timeout=0.1)
            except queue.Empty:
                continue
            if who == name:
                return f"{name} failed: {trace.strip().splitlines()[-1]}\n{trace}"
        if exitcode < 0:
            return f"{name} died (killed by {signal.Signals(-exitcode).name})"
        return f"{name} exited with code {exitcode}"

    def shutdown(self, grace: float = 25.0) -> None:
        """Ask politely, then terminate, then kill: no process survives this call."""
        self.stop.set()
        deadline = time.time() + grace
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.time()))
        for sig_method in ("terminate", "kill"):
            alive = [p for p in self.procs.values() if p.is_alive()]
            for proc in alive:
                getattr(proc, sig_method)()
            for proc in alive:
                proc.join(timeout=3.0)
        self.errors.close()
        self.errors.join_thread()
