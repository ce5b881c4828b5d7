"""Running train.py in a subprocess and checking that it leaves nothing behind."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_cmd(run_dir, *overrides):
    """train.py without its progress bar and, unless the test asks for them, without curves.png (2 s a
    run)."""
    curves = [] if any(o.startswith("curves=") for o in overrides) else ["curves=false"]
    return [sys.executable, os.path.join(ROOT, "train.py"), f"hydra.run.dir={run_dir}", "progress=false",
            *curves, *overrides]


def die_with_parent() -> None:
    """preexec_fn for a train.py the tests start: the kernel kills it if pytest dies (a killed pytest on a GPU
    machine would otherwise leave a launcher and its processes holding the GPU)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_train(run_dir, *overrides, timeout=300):
    return subprocess.run(train_cmd(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=die_with_parent)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(entry))
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def in_use_elsewhere(names: set[str]) -> set[str]:
    """Those of `names` (entries of /dev/shm) that a live process outside this test process's tree has mapped:
    another test run's semaphores, in use, not our leftovers. A named semaphore stays mapped while it is open;
    /proc/PID/maps shows it under the temporary name glibc created it with, so it is matched by inode."""
    inodes = {}
    for name in names:
        try:
            inodes[os.stat(f"/dev/shm/{name}").st_ino] = name
        except OSError:
            pass
    ours = {os.getpid(), *descendants(os.getpid())}
    used = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in ours:
            try:
                with open(f"/proc/{entry}/maps") as f:
                    used.update(inodes.get(int(line.split()[4]), None) for line in f if "/dev/shm/" in line)
            except (OSError, IndexError, ValueError):
                pass
    return used - {None}


TINY = ("rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_batch=16", "train.batch_groups=2",
        "train.micro_groups=2")


def require_sandbox() -> None:
    """Skip the test where bubblewrap cannot run (rewards/sandbox.py check())."""
    import pytest

    from rewards.sandbox import check
    try:
        check()
    except ValueError as e:
        pytest.skip(f"no sandbox here: {e}")
