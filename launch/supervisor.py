"""Start worker processes (`spawn`, or on the CPU from a forkserver: launch/forkserver.py), watch them, and
shut everything down on any exit path.

Watching covers processes that exit (a failure, a kill) and, with heartbeats (runtime/heartbeat.py), processes
that are alive but stuck: one whose last beat is older than its phase allows is named in one line
(`rollout-0 stuck in generate for 301 s`), its Python stack is written to `stacks/<name>-<unix time>.txt`
(faulthandler, on SIGUSR1 to its main thread, then a SIGCONT in case it was stopped; the signal's default
action then ends it), and it is handled like a process that died.

Once the essential processes have done their work (`finished`: trainer rank 0 has taken its last step), the
others (rollout workers) are retired: they are no longer watched for hangs, and their exit, however it comes,
is part of the shutdown, never a failure and never a restart. `shutdown` has its own limit and says which
process it had to kill.
"""
import ctypes
import errno
import faulthandler
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait

import torch
from setproctitle import setproctitle

from launch.memory import tree_peak_rss_mb, tree_pss_parts_mb
from runtime.shared import Finish, StopFlag


def _child_main(name, target, kwargs, errors, threads, stack_pipe, environ):
    _die_with_parent(name)
    # forked from the forkserver: the launcher's environment now, as `spawn` gives it
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and tells us to stop
    # The launcher reads the stack of a process it found stuck; then the signal's default action ends the
    # process, before it runs on (dump_stack).
    faulthandler.register(DUMP_SIGNAL, file=stack_pipe.fileno(), all_threads=True, chain=True)
    torch.set_num_threads(threads)
    try:
        target(**kwargs)
        fast_exit(0)
    except OSError as e:
        # A full disk is the user's to fix, and says all in one line; anything else carries its traceback.
        errors.put((name, str(e) if e.errno == errno.ENOSPC else traceback.format_exc()))
        sys.exit(1)
    except BaseException:
        errors.put((name, traceback.format_exc()))
        sys.exit(1)


def fast_exit(code: int) -> None:
    """End this process now that its work is done and written: every exit hook still runs (multiprocessing's
    joins of queue feeders and finalizers, logging's flush, the libraries' own), but not the interpreter's
    teardown of every module and object, which takes 1-3 s with torch and transformers loaded."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def remove_cuda_ipc_files(pid: int) -> list[str]:
    """Remove what a process that shared CUDA memory with another leaves in /dev/shm when it has ended: the
    CUDA driver's `cuda.shm.<n>.<pid in hex>.<n>` (left even by a clean exit; seen with CUDA 13 on an H200)
    and torch's reference counter `torch_<pid>_<n>_<n>` (left by an exit without the interpreter's teardown,
    as `fast_exit` and a kill make). Only for a process that has ended; the names removed."""
    pattern = re.compile(rf"cuda\.shm\.\d+\.{pid:x}\.\d+|torch_{pid}_\d+_\d+")
    try:
        names = [n for n in os.listdir("/dev/shm") if pattern.fullmatch(n)]
    except OSError:  # no /dev/shm: nothing was left there
        return []
    for name in names:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    return names


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


DUMP_SIGNAL = signal.SIGUSR1


def _to_main_thread(pid: int, sig: int) -> None:
    """Send `sig` to the main thread of process `pid` (glibc's tgkill). kill() lets any of its threads take
    the signal: the handler would run in a helper thread while the main one, continued, ran on. Off glibc, or
    where tgkill fails, kill() (which raises ProcessLookupError for a process that has gone)."""
    try:
        sent = ctypes.CDLL("libc.so.6").tgkill(pid, pid, sig) == 0
    except (OSError, AttributeError):
        sent = False
    if not sent:
        os.kill(pid, sig)


class Supervisor:
    def __init__(self, stacks_dir: str = "", hearts=None, allowance=None, ctx=None):
        """stacks_dir: where stuck processes' stacks go; hearts: the run's Heartbeats (None: exits only),
        allowance: how long each phase may go without a beat (runtime.heartbeat.Allowance), and ctx: how
        processes start (a multiprocessing context; `spawn` unless given)."""
        self.ctx = ctx or mp.get_context("spawn")
        self.stop = StopFlag()
        self.finished = Finish()  # set by trainer rank 0 after its last step: non-essential processes retire
        self.errors = self.ctx.Queue()
        self.stacks_dir, self.hearts = stacks_dir, hearts
        self.allowance = allowance
        self.procs: dict[str, mp.Process] = {}
        self.stack_pipes: dict[str, object] = {}  # our end of each process's faulthandler pipe
        self.why: dict[str, str] = {}  # processes we killed for being stuck: the one line that says so
        self.essential: set[str] = set()  # processes whose clean exit means the run is done
        self.pids: list[int] = []  # every process started, restarts too: their CUDA IPC files go at shutdown
        # Largest total memory of the launcher and all its processes. Reading it walks every process's page
        # tables (about 0.2 s for a SmolLM2 run's tree, 2 cores): sampled at most every second and so that it
        # takes no more than 1/20 of the launcher's time.
        self.peak_mb = 0.0
        # that total's split by process (launch/memory.py) when it peaked
        self.peak_parts: dict[str, float] = {}
        self.peak_each: dict[str, float] = {}  # each process's own largest share, whenever it came
        # The largest resident set any one process reached: the kernel's high-water mark, read at each sample
        # (a forkserver's children are not the launcher's to wait for, so RUSAGE_CHILDREN misses them).
        self.peak_rss_mb = 0.0
        self._next_sample = 0.0

    def start(self, name: str, target, kwargs: dict, threads: int, essential: bool = False) -> None:
        """Start `target(**kwargs)` in a new process; a name already used must belong to a dead process
        (a restart)."""
        if name in self.procs:
            assert self.procs[name].exitcode is not None, f"{name} is still running"
            self.procs[name].join()
        if name in self.stack_pipes:
            self.stack_pipes.pop(name).close()
        ours, theirs = self.ctx.Pipe(duplex=False)
        if self.hearts is not None and name in self.hearts.names:
            self.hearts.restart(name)
        proc = self.ctx.Process(target=_child_main, name=name,
                                args=(name, target, kwargs, self.errors, threads, theirs, dict(os.environ)))
        proc.start()
        theirs.close()
        self.procs[name], self.stack_pipes[name] = proc, ours
        self.pids.append(proc.pid)
        if essential:
            self.essential.add(name)

    def watch(self, on_failure=None) -> str | None:
        """Block until every essential process has exited cleanly (None), or a process fails and
        `on_failure(name, message)` does not start a replacement under the same name (the failure's message).
        A retired process's exit is neither."""
        exited: set[str] = set()  # processes whose exit has been handled
        while True:
            live = {p.sentinel: name for name, p in self.procs.items() if name not in exited}
            wait(list(live), timeout=1.0)
            self._sample_memory()
            self._kill_stuck()
            for name, proc in list(self.procs.items()):
                if name in exited or proc.exitcode is None:
                    continue
                if not self.retired(name):
                    if proc.exitcode != 0:
                        message = self.why.pop(name, None) or self._describe(name, proc.exitcode)
                        if on_failure is not None and not self.stop.is_set() and on_failure(name, message):
                            continue
                        if not self.retired(name):  # (the steps may have finished while on_failure looked)
                            return message
                    elif name not in self.essential:
                        return f"{name} exited before the run was done"
                exited.add(name)
            if self.essential <= exited:
                return None

    def retired(self, name: str) -> bool:
        """`name` is no longer needed: a non-essential process once the essential ones have finished their
        work."""
        return name not in self.essential and self.finished.is_set()

    def ended(self) -> bool:
        """Has any process ended (stuck ones are ended here)? For waits outside `watch`, such as the GPU
        plan's wait for its engines."""
        self._kill_stuck()
        return any(p.exitcode is not None for p in self.procs.values())

    def _kill_stuck(self) -> None:
        """Kill every live process whose heartbeat is too old, after dumping its stack; `why` says so."""
        if self.hearts is None or self.stop.is_set():
            return
        for name, phase, age in self.hearts.stuck(self.allowance):
            proc = self.procs.get(name)
            if proc is None or proc.exitcode is not None or self.retired(name):
                continue
            where = self.dump_stack(name)
            proc.kill()
            proc.join()
            self.why[name] = (f"{name} stuck in {phase} for {age:.0f} s"
                              + (f" (its stack: {where})" if where else ""))

    def dump_stack(self, name: str) -> str | None:
        """Write `name`'s Python stack (every thread) to stacks_dir; its path, or None if it gave none. The
        process ends as it writes it: it cannot run on in between, as a stopped one would once continued, and
        deliver its first group a moment after it was found stuck in its set-up (seen with a tiny model on a
        fast CPU)."""
        proc, pipe = self.procs[name], self.stack_pipes[name]
        try:
            # pending while it is stopped: handled first when it continues
            _to_main_thread(proc.pid, DUMP_SIGNAL)
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process runs no handler
        except ProcessLookupError:
            return None
        text, deadline = b"", time.monotonic() + 5.0
        while time.monotonic() < deadline and pipe.poll(0.5 if text else deadline - time.monotonic()):
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:  # it has ended and closed its end
                break
            text += chunk
        if not text or not self.stacks_dir:
            return None
        os.makedirs(self.stacks_dir, exist_ok=True)
        path = os.path.join(self.stacks_dir, f"{name}-{int(time.time())}.txt")
        with open(path, "wb") as f:
            f.write(text)
        return path

    def _sample_memory(self) -> None:
        now = time.monotonic()
        if now < self._next_sample:
            return
        parts = tree_pss_parts_mb({p.pid: name for name, p in self.procs.items() if p.pid is not None})
        total = sum(parts.values())
        if total > self.peak_mb:
            self.peak_mb, self.peak_parts = total, parts
        for name, mb in parts.items():
            self.peak_each[name] = max(mb, self.peak_each.get(name, 0.0))
        self.peak_rss_mb = max(self.peak_rss_mb, tree_peak_rss_mb())
        self._next_sample = now + max(1.0, 20 * (time.monotonic() - now))

    def _describe(self, name: str, exitcode: int) -> str:
        deadline = time.time() + 1.0
        while time.time() < deadline:
            try:
                who, trace = self.errors.get(timeout=0.1)
            except queue.Empty:
                continue
            if who == name:
                lines = trace.strip().splitlines()
                return f"{name} failed: {lines[-1]}" + (f"\n{trace}" if len(lines) > 1 else "")
        if exitcode == -signal.SIGKILL:  # we kill only at shutdown and when stuck, and say so there
            return (f"{name} died (killed by SIGKILL: probably the kernel's out-of-memory killer; the run's "
                    f"processes used up to {self.peak_mb:,.0f} MB)")
        if exitcode < 0:
            return f"{name} died (killed by {signal.Signals(-exitcode).name})"
        return f"{name} exited with code {exitcode}"

    def shutdown(self, grace: float = 25.0) -> str | None:
        """Ask politely, then terminate, then kill: no process survives this call. Returns one line naming
        those that had not stopped within `grace` seconds of being asked, if any."""
        self.stop.set()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            alive = [p for p in self.procs.values() if p.exitcode is None]
            if not alive:
                break
            # a stopped process cannot see the stop flag (again each round: it may stop late)
            for proc in alive:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            wait([p.sentinel for p in alive], timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        late = [name for name, proc in self.procs.items() if proc.is_alive()]
        for sig_method in ("terminate", "kill"):
            alive = [p for p in self.procs.values() if p.is_alive()]
            for proc in alive:
                getattr(proc, sig_method)()
            for proc in alive:
                proc.join(timeout=3.0)
        self.errors.close()
        self.errors.join_thread()
        for pid in self.pids:  # every one has ended by now
            remove_cuda_ipc_files(pid)
        for pipe in self.stack_pipes.values():
            pipe.close()
        if late:
            return f"{', '.join(late)} did not stop within {grace:g} s of being asked to; killed"
        return None
