"""Run untrusted programs: each run is a bubblewrap (`bwrap`) container the program cannot get out of.

    box = Sandbox(Limits(timeout_s=3, memory_mb=1024, processes=16, file_mb=16, output_kb=1024))
    runs = box.run([Job(program, tests=("assert f(1) == 2",)), Job(program, stdin="1 2\\n")], parallel=4)
    runs[0].passed, runs[1].stdout, runs[1].killed          # [True], "3\\n", None

What a run sees: a read-only /usr and the interpreter's own folder, a new /proc that shows only its own
processes, a minimal /dev, a private size-limited /tmp, and nothing else: not the repository, the home
directory, the run directory, nor the network (an empty network namespace). The rest of the file system is
read-only. It runs unprivileged: as uid 65534 when ringrl runs as root (a real uid, so the kernel enforces
the process limit), else as the user, in a user namespace where the process limit is counted per sandbox.
Limits: CPU seconds, address space, processes, file size, bytes of output kept (more kills the run) and wall
clock. `--unshare-pid --die-with-parent --new-session`: when a run ends or is killed, everything it started
goes with it, a `setsid()` child included.

Inside, rewards/sandbox_runner.py sets the limits, runs the program, and reports each case with a marker that
is random per run (see there); asserts arrive rewritten by `guard`, so that only plain values are compared.
For stdin/stdout cases the expected output never enters the sandbox: the caller compares `stdout`.
"""
import ast
import functools
import marshal
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
SANDBOX_UID = 65534  # "nobody": the uid a root-run ringrl drops to
INSTALL = ("install bubblewrap: `sudo apt-get install bubblewrap` "
           "(Debian/Ubuntu; `bash setup.sh` as root does it), `sudo dnf install bubblewrap` (Fedora/RHEL)")


@dataclass(frozen=True)
class Limits:
    """One run's limits; task=code's values come from its schema (tasks/code.py: timeout_s, memory_mb,
    ...)."""
    timeout_s: float  # wall clock of one run; its CPU seconds are capped at the next whole second
    memory_mb: int  # address space (a larger allocation raises MemoryError: killed for "memory")
    processes: int  # processes and threads the run may have at once
    file_mb: int  # the largest file it may write, and the size of its private /tmp
    output_kb: int  # stdout and stderr kept; more kills the run (killed for "output")


PROBE_LIMITS = Limits(timeout_s=10.0, memory_mb=1024, processes=16, file_mb=16, output_kb=64)  # check()'s run


@dataclass(frozen=True)
class Job:
    program: str
    setup: str = ""  # code run before the program (a dataset's imports)
    tests: tuple[str, ...] | None = None  # function + asserts: each a case, run in order after the program
    stdin: str = ""  # stdin/stdout (tests is None): the program's input


@dataclass
class Run:
    passed: list[bool]  # per case: reported passed by the runner (stdin/stdout: exited cleanly)
    stdout: str = ""
    killed: str | None = None  # "time", "memory" or "output" when a limit ended the run
    stderr: str = field(default="", repr=False)


class Sandbox:
    def __init__(self, limits: Limits, isolate: bool = True):
        """`isolate=False` runs the same runner with the same limits but no container: for bench/sandbox.py's
        baseline only, never for model output."""
        self.limits, self.isolate = limits, isolate
        with open(RUNNER) as f:
            runner = f.read()
        python = interpreter() if isolate else sys.executable
        self.argv = ((container(python, limits.file_mb) if isolate else [])
                     + [python, "-I", "-S", "-c", runner])
        root = isolate and os.geteuid() == 0
        self.as_user = dict(user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[]) if root else {}

    def run(self, jobs: list[Job], parallel: int = 1, deadline: float | None = None) -> list[Run]:
        """Run every job, up to `parallel` at a time; a job not started by `deadline` (time.monotonic) is
        counted as killed for time. Runs are killed at their own timeout or at the deadline, whichever is
        first."""
        runs: list[Run | None] = [None] * len(jobs)
        todo = list(enumerate(jobs))[::-1]
        running: dict[int, _Process] = {}
        selector = selectors.DefaultSelector()
        try:
            while todo or running:
                while todo and len(running) < parallel:
                    i, job = todo.pop()
                    end = time.monotonic() + self.limits.timeout_s
                    if deadline is not None and time.monotonic() >= deadline:
                        runs[i] = Run([False] * _cases(job), killed="time")
                        continue
                    running[i] = _Process(self, job, min(end, deadline or end), selector)
                wait = min(p.deadline for p in running.values()) - time.monotonic() if running else 0
                for key, _ in selector.select(max(wait, 0.0)):
                    key.data.ready(key.fileobj)
                now = time.monotonic()
                for i, process in list(running.items()):
                    if now >= process.deadline and not process.finished():
                        process.kill("time")
                    if process.finished():
                        runs[i] = process.result()
                        del running[i]
        finally:
            for process in running.values():
                process.kill(None)
            selector.close()
        return runs

    def command(self, fd: int) -> list[str]:
        return self.argv + [str(fd)]


class _Process:
    """One run: the bwrap process, its pipes and exit descriptor in the caller's selector, and what it
    wrote."""

    def __init__(self, box: Sandbox, job: Job, deadline: float, selector):
        self.job, self.deadline, self.selector = job, deadline, selector
        self.marker = secrets.token_hex(16)
        self.cap = box.limits.output_kb * 1024
        self.out, self.err, self.killed = bytearray(), bytearray(), None
        limits = box.limits
        tests = None if job.tests is None else [guard(test) for test in job.tests]
        payload = marshal.dumps({  # version 4: plain values read the same by any Python 3 the sandbox runs
            "marker": self.marker, "program": job.program, "setup": job.setup, "tests": tests,
            "exact_numbers": any(name in text for text in (tests or []) + [job.setup]
                                 for name in ("Fraction", "Decimal", "fractions", "decimal")),
            "limits": {"cpu_s": max(1, math.ceil(limits.timeout_s)), "memory_bytes": limits.memory_mb << 20,
                       "processes": limits.processes, "file_bytes": limits.file_mb << 20}}, 4)
        job_fd, stdin_fd = _memfd(payload), _memfd(job.stdin.encode())
        try:
            self.popen = subprocess.Popen(
                box.command(job_fd), stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(job_fd,), start_new_session=True, env={}, **box.as_user)
        finally:
            os.close(job_fd)
            os.close(stdin_fd)
        self.exit_fd = os.pidfd_open(self.popen.pid)  # readable once the outer bwrap has exited
        self.open = [self.popen.stdout, self.popen.stderr, self.exit_fd]
        for f in self.open:
            os.set_blocking(f if isinstance(f, int) else f.fileno(), False)
            selector.register(f, selectors.EVENT_READ, self)

    def ready(self, f):
        if f not in self.open:  # closed by a kill earlier in the same batch of ready files
            return
        if f is self.exit_fd:
            self._close(f)
            return
        try:
            data = os.read(f.fileno(), 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self._close(f)
            return
        (self.out if f is self.popen.stdout else self.err).extend(data)
        if len(self.out) + len(self.err) > self.cap:
            self.kill("output")

    def _close(self, f):
        self.selector.unregister(f)
        os.close(f) if f is self.exit_fd else f.close()
        self.open.remove(f)

    def finished(self) -> bool:
        return not self.open

    def kill(self, reason: str | None):
        self.killed = self.killed or reason
        try:  # the outer bwrap; --die-with-parent takes the container, and all it started, with it
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        for f in list(self.open):
            self._close(f)

    def result(self) -> Run:
        code = self.popen.wait()
        passed = [False] * _cases(self.job)
        memory = False
        for line in self.err.decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == self.marker:
                case, status = int(parts[1]), parts[2]
                memory |= status == "memory"
                if 0 <= case < len(passed):
                    passed[case] = status == "ok"
        killed = self.killed
        if killed is None and memory:
            killed = "memory"
        if killed is None and code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):  # the CPU-seconds limit
            killed = "time"
        return Run(passed, self.out.decode(errors="replace"), killed, self.err.decode(errors="replace"))


class _Guard(ast.NodeTransformer):
    """Every value an assert compares, or tests for truth, goes through the runner's `__ringrl_plain__`
    first."""

    def visit_Assert(self, node):
        self.generic_visit(node)
        node.test = self.check(node.test)
        return node

    def check(self, expr):
        if isinstance(expr, ast.BoolOp):
            expr.values = [self.check(v) for v in expr.values]
            return expr
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            expr.operand = self.check(expr.operand)
            return expr
        if isinstance(expr, ast.Compare):
            expr.left = self.plain(expr.left)
            expr.comparators = [self.plain(c) for c in expr.comparators]
            return expr
        return self.plain(expr)

    @staticmethod
    def plain(expr):
        return ast.Call(ast.Name("__ringrl_plain__", ast.Load()), [expr], [])


@functools.lru_cache(maxsize=4096)
def guard(test: str) -> str:
    """A test's source with its asserts' values checked (rewards/sandbox_runner.py `plain_checker`). Tests are
    trusted text (the dataset's): parsing them here runs nothing, and keeps `ast` out of every run's
    start-up."""
    return ast.unparse(ast.fix_missing_locations(_Guard().visit(ast.parse(test))))


def _cases(job: Job) -> int:
    return 1 if job.tests is None else len(job.tests)


def _memfd(data: bytes) -> int:
    """A descriptor of an anonymous file holding `data`, at its start: nothing on disk to find or leave
    behind."""
    fd = os.memfd_create("ringrl-sandbox", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def interpreter() -> str:
    """The Python the sandbox runs: this one's base interpreter if the sandbox's user can read it (a venv's
    base may sit in a 0700 home directory), else the system's python3."""
    own = os.path.realpath(os.path.join(sys.base_exec_prefix, "bin", os.path.basename(sys.executable)))
    if not os.path.isfile(own):
        own = os.path.realpath(sys.executable)
    candidates = [own] + [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
    for path in candidates:
        if os.geteuid() != 0 or _world_readable(path):
            return os.path.realpath(path)
    raise ValueError(f"no Python for the sandbox: {own} is not readable by uid {SANDBOX_UID} and there is no "
                     "/usr/bin/python3; install python3 system-wide (`apt-get install python3`)")


def _world_readable(path: str) -> bool:
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(path)
    while parent != "/":
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    return True


def container(python: str, tmp_mb: int) -> list[str]:
    """bwrap's command line up to the program: namespaces, the file system view, the session."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ValueError("task=code runs generated programs under bubblewrap, which is not "
                         f"installed; {INSTALL}")
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    # <prefix>/bin/python3.x: bind <prefix> (the stdlib is there)
    home = os.path.dirname(os.path.dirname(python))
    if not home.startswith("/usr/"):
        argv += ["--ro-bind", home, home]
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(tmp_mb << 20),
             "--tmpfs", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv",
             "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv",
             "LANG", "C.UTF-8"]
    if _bwrap_version(bwrap) >= (0, 8):
        argv.append("--disable-userns")  # no nested user namespace: less of the kernel within reach
    return argv


@functools.lru_cache(maxsize=None)
def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    out = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.split()
    try:
        return tuple(int(x) for x in out[-1].split("."))
    except (IndexError, ValueError):
        return (0,)


@functools.lru_cache(maxsize=None)
def check() -> None:
    """Raise a one-line ValueError unless a sandboxed program can run here (once per process)."""
    box = Sandbox(PROBE_LIMITS)
    run = box.run([Job("x = 6 * 7", tests=("assert x == 42",))])[0]
    if not run.passed[0]:
        reason = (run.stderr.strip().splitlines()
                  or [f"killed: {run.killed}" if run.killed else "no report"])[0]
        raise ValueError(f"bubblewrap cannot start a sandbox here ({reason}); it needs unprivileged user "
                         "namespaces (sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu "
                         "kernel.apparmor_restrict_unprivileged_userns=0)")
