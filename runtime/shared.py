"""What the launcher shares with every rollout worker and trainer rank, made before the first spawn.

    shared = Shared(ring, gate, weights, WorkerCounters(workers), StopFlag())
    rollout worker:  shared.gate.try_start(); shared.ring.put(group); shared.counters.add(w, "groups")
    trainer rank 0:  shared.ring.get(); shared.gate.set_version(v); shared.counters.total("tokens")
    trainer rank 0:  shared.finish.set(read) after its last step: rollout workers stop, none is restarted
    launcher:        shared.reclaim(w) after worker w died; shared.stop.set() to end the run

Everything in it is shared memory or a handle to it, so it crosses `spawn` as one argument. Nothing here can
be held by a process that dies: the counters and the stop flag are plain shared tensors without locks, and the
one lock (`Finish`'s) guards a short piece of bookkeeping and is taken with a timeout.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from buffer.ring import TrajectoryRing
from buffer.staleness import StalenessGate
from runtime.cores import Cores
from runtime.heartbeat import Heartbeats, NoHeart


class StopFlag:
    """The launcher's "stop now" to every process: Event's `set`/`is_set` on one shared byte. An mp.Event
    takes a lock on every `is_set`, and a worker killed inside it would hang everyone else's next call."""

    def __init__(self):
        self._flag = torch.zeros(1, dtype=torch.uint8).share_memory_()

    def set(self) -> None:
        self._flag[0] = 1

    def is_set(self) -> bool:
        return bool(self._flag[0])


def stop_when_dead(process, stop: "StopFlag | None" = None) -> "StopFlag":
    """A stop flag that trips as soon as `process` (a multiprocessing Process) ends: for a weight publisher
    whose engine runs in a child that no launcher supervises (the GPU tests and benchmarks), so that a dead
    engine ends the wait for its acks at once instead of after the channel's 600 s."""
    import threading
    from multiprocessing.connection import wait

    stop = stop or StopFlag()

    def watch():
        wait([process.sentinel])
        stop.set()

    threading.Thread(target=watch, name="stop-when-dead", daemon=True).start()
    return stop


class Finish:
    """Trainer rank 0's word that it has taken its last step: the rollout workers are no longer needed, they
    stop, and the launcher restarts none of them (launch/supervisor.py retires them).

    Rank 0 sets it and reads the counters for its last metrics row under the lock that the launcher's restart
    bookkeeping (`Shared.reclaim`) takes too, so a restart is either counted in that row or never made."""

    def __init__(self):
        self._flag = torch.zeros(1, dtype=torch.uint8).share_memory_()
        self._lock = mp.get_context("spawn").Lock()

    def is_set(self) -> bool:
        return bool(self._flag[0])

    def set(self, read=lambda: None):
        """Mark the steps finished; `read()`, run under the lock, gives what is returned
        (the last row's counts)."""
        with self._lock:
            self._flag[0] = 1
            return read()

    @contextmanager
    def unless_set(self, timeout: float = 10.0):
        """Hold the lock for a short piece of bookkeeping; yields whether the steps are finished. A lock held
        for `timeout` seconds belongs to a rank 0 that died inside `set`: the steps count as finished (the
        trainer's death ends the run anyway)."""
        if not self._lock.acquire(timeout=timeout):
            yield True
            return
        try:
            yield self.is_set()
        finally:
            self._lock.release()


SANDBOX_KILLS = ("sandbox_kills_time", "sandbox_kills_memory", "sandbox_kills_output")
# Multi-turn episodes, counted by the rollout worker: the environment's own counts (envs.COUNTED), what went
# wrong around it, and where an episode's time went (milliseconds, summed over episodes).
EPISODE_COUNTERS = ("episodes", "successes", "tool_calls", "tool_errors", "tool_timeouts", "parse_errors",
                    "unknown_tools", "env_errors", "env_timeouts", "observations_cut",
                    "observations_sanitized", "template_checks", "template_mismatches", "resumed_prefills",
                    "full_prefills", "model_ms", "env_ms", "stuck_threads", "info_ignored",
                    # agent code through the endpoint (envs/agent.py)
                    "agent_calls", "agent_tokens", "agent_segments", "agent_dropped_tokens",
                    "agent_sampling_overridden", "agent_cut_records")


class WorkerCounters:
    """Per rollout worker, counts that only grow (but for the restart bookkeeping): written by the worker,
    read by trainer rank 0 for its metrics and by the launcher when a worker dies."""
    NAMES = (
        "tokens",  # tokens generated
        "groups",  # groups delivered into the ring
        "started",  # groups started (allowed by the gate)
        "next_group",  # index of the next group of this worker: where a replacement starts
        "reward_timeouts",  # verifier calls killed for running past reward.timeout_s
        "reward_errors",  # verifier calls that raised
        *SANDBOX_KILLS,  # task=code: sandboxed runs a limit ended, by limit (rewards/code.py)
        "restarts",  # times the launcher restarted this worker
        "lost_groups",  # groups started but never delivered by a worker that died
        "prompts_truncated",  # prompts over rollout.max_prompt_len, cut
        "prompts_skipped",  # prompts over rollout.max_prompt_len, skipped
        *EPISODE_COUNTERS,  # multi-turn tasks (envs/episode.py), logged as episode/<name>
    )

    def __init__(self, workers: int):
        self._table = torch.zeros(workers, len(self.NAMES), dtype=torch.long).share_memory_()
        self._column = {name: i for i, name in enumerate(self.NAMES)}

    def __len__(self) -> int:
        return self._table.shape[0]

    def get(self, worker: int, name: str) -> int:
        return int(self._table[worker, self._column[name]])

    def set(self, worker: int, name: str, value: int) -> None:
        self._table[worker, self._column[name]] = value

    def add(self, worker: int, name: str, n: int = 1) -> None:
        self._table[worker, self._column[name]] += n

    def rows(self, workers: list[int]) -> torch.Tensor:
        """Those workers' counts (a copy): a generator node's, sent to the trainer node (cluster=ray)."""
        return self._table[workers].clone()

    def set_rows(self, workers: list[int], rows: torch.Tensor) -> None:
        self._table[workers] = rows

    def total(self, name: str) -> int:
        """Summed over the workers."""
        return int(self._table[:, self._column[name]].sum())


class NodeCounters:
    """cluster=ray: per generator node, what the trainer node's forwarding thread counted
    (launch/ray_nodes.py), read by trainer rank 0 for each metrics row as ray/node<i>_<name>; and the weight
    broadcasts."""
    COUNTS = ("groups", "lost_groups", "restarts", "lost", "replacements", "fences", "written_off", "drained")
    NAMES = (*COUNTS, "forward_calls", "forward_s", "broadcasts", "broadcast_s")

    def __init__(self, nodes: list[int]):
        self.nodes = list(nodes)  # each row's index in cluster.ray.nodes
        self._table = torch.zeros(len(nodes), len(self.NAMES), dtype=torch.float64).share_memory_()

    def set(self, row: int, **values: float) -> None:
        for name, value in values.items():
            self._table[row, self.NAMES.index(name)] = value

    def metrics(self) -> dict:
        """ray/node<i>_<each of COUNTS>, _forward_s (a call's mean) and ray/broadcasts (weight pushes, every
        node's), ray/broadcast_s (a push's mean), as of now."""
        out = {}
        for row, node in enumerate(self.nodes):
            v = dict(zip(self.NAMES, self._table[row].tolist()))
            calls = v["forward_calls"]
            out.update({f"ray/node{node}_{name}": int(v[name]) for name in self.COUNTS})
            out[f"ray/node{node}_forward_s"] = v["forward_s"] / calls if calls else 0.0
        broadcasts, seconds = (self._table[0, self.NAMES.index(name)].item()
                               for name in ("broadcasts", "broadcast_s"))
        out.update({"ray/broadcasts": int(broadcasts),
                    "ray/broadcast_s": seconds / broadcasts if broadcasts else 0.0})
        return out


@dataclass(frozen=True)
class Shared:
    ring: TrajectoryRing  # finished groups, worker -> trainer rank 0
    gate: StalenessGate  # how many groups may be started (max_staleness)
    weights: object  # the plan's weight path (engines.base.WeightPath), trainer -> engines
    counters: WorkerCounters
    stop: StopFlag
    finish: Finish = field(default_factory=Finish)  # trainer rank 0 has taken its last step
    cores: Cores | None = None  # who uses the CPU cores now (None: nobody changes thread counts)
    hearts: Heartbeats | None = None  # each process's last progress and phase (None: nobody watches)
    nodes: NodeCounters | None = None  # cluster=ray: the generator nodes' counts (None: one machine)

    def heart(self, name: str):
        """`name`'s heartbeat (runtime/heartbeat.py), or one that goes nowhere when nobody watches."""
        return self.hearts.of(name) if self.hearts is not None else NoHeart()

    def rollouts_over(self) -> bool:
        """Rollout workers stop: the launcher asked everyone to, or the trainer has taken its last step."""
        return self.stop.is_set() or self.finish.is_set()

    def reclaim(self, worker: int) -> int | None:
        """After `worker` died: its half-written ring slot is freed, the groups it started but never delivered
        are dropped and their staleness budget handed back, and its restart is counted. Groups it had put in
        the ring stay (none lost, none twice). Returns how many were dropped (a replacement starts at the
        worker's `next_group`), or None, touching nothing, once the trainer has taken its last step: no
        restart then."""
        with self.finish.unless_set() as finished:
            if finished:
                return None
            return self._reclaim(worker)

    def _reclaim(self, worker: int) -> int:
        self.ring.reclaim(worker)
        self.gate.recover()
        lost = self.counters.get(worker, "started") - self.counters.get(worker, "groups")
        if lost > 0:
            self.gate.cancel(lost)
        self.counters.set(worker, "started", self.counters.get(worker, "groups"))
        self.counters.add(worker, "lost_groups", max(lost, 0))
        self.counters.add(worker, "restarts")
        return lost
