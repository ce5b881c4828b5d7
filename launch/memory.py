"""Memory of a process tree, as the kernel accounts it (Linux /proc), and shared memory nobody holds any
more."""
import os


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (field 3, the state, first), or None once `pid` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The live children of `pid` (an empty list once it is gone)."""
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return kids


def _pss_kb(pid: int) -> int:
    """Proportional set size: shared pages (the ring, the weight store) count once across the processes
    that map them, so the sum over a tree is the memory the run really holds."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_mb(root: int | None = None) -> float:
    """Total proportional resident memory of `root` (default: this process) and all its descendants, in
    MiB."""
    todo, total = [root or os.getpid()], 0
    while todo:
        pid = todo.pop()
        total += _pss_kb(pid)
        todo += children(pid)
    return total / 1024


def tree_peak_rss_mb(root: int | None = None) -> float:
    """The largest peak resident set (VmHWM) of any one process in `root`'s tree (default: this process), in
    MiB."""
    todo, peak = [root or os.getpid()], 0
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                peak = max([peak] + [int(line.split()[1]) for line in f if line.startswith("VmHWM:")])
        except OSError:
            pass
        todo += children(pid)
    return peak / 1024


def tree_pss_parts_mb(names: dict[int, str]) -> dict[str, float]:
    """The same total as `tree_pss_mb()`, split: this process alone ("launcher"), the subtree of each process
    in `names` under its name, wherever it sits below (a forkserver's children are the launcher's
    grandchildren), and the processes in between and the subtrees of others under "other", in MiB."""
    parts, todo = {"launcher": _pss_kb(os.getpid()) / 1024}, children(os.getpid())
    while todo:
        pid = todo.pop()
        if pid in names:
            parts[names[pid]] = parts.get(names[pid], 0.0) + tree_pss_mb(pid)
        else:
            parts["other"] = parts.get("other", 0.0) + _pss_kb(pid) / 1024
            todo += children(pid)
    return parts


def remove_unmapped_semaphores() -> list[str]:
    """Remove multiprocessing's named semaphores (/dev/shm/sem.mp-*) that no live process has mapped: what a
    process tree killed whole leaves (its resource tracker killed with it, as when a Ray node's raylet dies).
    An open semaphore stays mapped, and multiprocessing keeps every one it uses open, so nothing in use goes.
    glibc maps a new semaphore before it has its name, and /proc/PID/maps may show the temporary one: matched
    by inode."""
    try:
        inodes = {os.stat(f"/dev/shm/{n}").st_ino: n for n in os.listdir("/dev/shm")
                  if n.startswith("sem.mp-")}
    except OSError:
        return []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/maps") as f:
                    for line in f:
                        if "/dev/shm/" in line:
                            inodes.pop(int(line.split()[4]), None)
            except (OSError, IndexError, ValueError):
                pass
    for name in inodes.values():
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    return sorted(inodes.values())
