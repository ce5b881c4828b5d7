"""The simulated cluster's reaper (cluster=ray with cluster.ray.address=""), a process in a session of its own
that outlives the launcher. Ray runs the simulated nodes' daemons as the launcher's children, and some of them
(each node's dashboard and runtime-env agents) outlive their raylet. When the launcher dies without its
shutdown (killed: the trainer node lost), the reaper kills every process it saw in the launcher's tree,
removes the semaphores they leave in /dev/shm, and exits. After a normal shutdown the launcher stops it.

    python -m launch.reaper LAUNCHER_PID
"""
import os
import signal
import sys
import time

from launch.memory import children, remove_unmapped_semaphores, stat_fields


def started(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): tells a process from a later one given the same pid."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def tree(root: int) -> dict[int, int]:
    """Every process below `root`, with its start time."""
    seen, todo = {}, children(root)
    while todo:
        pid = todo.pop()
        start = started(pid)
        if start is not None and pid not in seen:
            seen[pid] = start
            todo += children(pid)
    return seen


def kill_and_wait(processes: dict[int, int]) -> None:
    """SIGKILL each of `processes` (pid: start time) still the same process, and wait (10 s at most) until
    they are gone: their mappings of shared memory go only then."""
    for pid, start in processes.items():
        if started(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10.0
    while any(started(pid) == start for pid, start in processes.items()) and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    launcher = int(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher's own shutdown: nothing to do
    seen: dict[int, int] = {}
    while os.getppid() == launcher:  # reparented: the launcher is gone
        seen.update(tree(launcher))
        seen.pop(os.getpid(), None)
        time.sleep(0.5)
    kill_and_wait(seen)
    remove_unmapped_semaphores()


if __name__ == "__main__":
    main()
