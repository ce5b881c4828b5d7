"""Where the CPU cores go: to the side that is working (CPU plan, `cluster.threads_per_process=0`).

C cores, W rollout workers, R trainer ranks. A process's torch thread count is one of three:

    phase of the run                          each trainer rank    each rollout worker
    the trainers wait for data                (idle)               C // W     (generation has the cores)
    a step that nothing else can overlap      C // R               (idle)     (the trainers have them)
    a step beside generation                  C // (W + R)         C // (W + R)

"Nothing else can overlap" is read from the run's state at the step boundary, never from a clock. With
max_staleness = 0 it is every step: the gate lets generation start the next batch only once the step has
published its weights, so trainers and workers simply keep their full counts all run long and a fixed-seed
run stays reproducible. With max_staleness > 0 a step runs alone when the gate has no budget left and no
group is being generated (every group started is already in the ring or the trainer's hands); otherwise the
cores are shared. Trainer rank 0 decides at each step boundary and writes the phase here; every worker reads
it between two decode steps and changes its thread count only when the phase changed.

Inside a shared step the trainer follows the workers layer by layer: each worker says whether it is decoding
(its engine has sequences to step) or idle (every episode waits for its environment, or the gate is shut), and
before each decoder layer's forward and backward the trainer takes C // R threads while no worker decodes, and
C // (W + R) while one does (`follow_workers`). A slow tool uses no core, so the trainer need not leave one
for a worker that only waits (bench/agentic.py).

A fixed `cluster.threads_per_process=N` gives every process N threads throughout (the layout of earlier runs).
"""
import time

import torch

WAITING, ALONE, SHARED = 0, 1, 2


class Cores:
    def __init__(self, cores: int, workers: int, ranks: int, max_staleness: int, fixed: int = 0):
        self.cores, self.workers, self.ranks = cores, workers, ranks
        self.synchronous, self.fixed = max_staleness == 0, fixed
        self.share = max(1, cores // (workers + ranks))
        self._phase = torch.tensor([WAITING], dtype=torch.uint8).share_memory_()
        # per worker: 1 while it decodes
        self._decoding = torch.zeros(workers, dtype=torch.uint8).share_memory_()

    @property
    def moves_in_step(self) -> bool:
        """Whether a step's thread count can change inside it (`follow_workers`): asynchronous, not fixed."""
        return not (self.synchronous or self.fixed)

    @property
    def phase(self) -> int:
        return int(self._phase[0])

    def most(self, side: str) -> int:
        """The most threads a process of `side` ('trainer' or 'worker') ever uses: its OpenMP pool's size."""
        if self.fixed:
            return self.fixed
        return max(1, self.cores // max(1, self.ranks if side == "trainer" else self.workers))

    def trainer_step(self, alone: bool) -> int:
        """Trainer rank 0 at a step boundary, before the step: record whether the step has the cores to itself
        (`alone`, see `step_runs_alone`), and return each rank's thread count for it."""
        alone = alone or self.synchronous
        self._phase[0] = ALONE if alone else SHARED
        return self.trainer_threads(alone)

    def trainer_threads(self, alone: bool) -> int:
        if self.fixed:
            return self.fixed
        return self.most("trainer") if alone or self.synchronous else self.share

    def trainer_waiting(self) -> None:
        """Trainer rank 0 is about to wait for data: the workers may take the cores."""
        self._phase[0] = WAITING

    def trainer_after_step(self) -> int:
        """Trainer rank 0, its weights published, before it lets generation start (logging, evaluation): the
        cores are shared. Returns the thread count for that part."""
        if not self.synchronous:
            self._phase[0] = SHARED
        return self.trainer_threads(alone=False)

    def trainer_now(self) -> int:
        """Trainer ranks inside a step, before a decoder layer: a shared step takes every core while no worker
        is decoding."""
        if self.fixed:
            return self.fixed
        alone = self.synchronous or self.phase != SHARED or not bool(self._decoding.any())
        return self.trainer_threads(alone)

    def worker_decoding(self, worker: int, decoding: bool) -> None:
        """Worker `worker` is about to decode (True), or has nothing to decode until an environment, the
        scorer or the gate lets it (False)."""
        self._decoding[worker] = int(decoding)

    def worker_threads(self) -> int:
        """A rollout worker's count for its next decode step."""
        if self.fixed:
            return self.fixed
        if self.synchronous or self.phase == WAITING:
            return self.most("worker")
        return self.share


def step_runs_alone(gate_exhausted: bool, in_flight: int) -> bool:
    """No generation can overlap the step: the gate allows no new group until it publishes, and no group is
    being generated or scored (`in_flight`: groups the workers started and have not delivered)."""
    return gate_exhausted and in_flight <= 0


class Threads:
    """A process's torch thread count, changed only when it differs (`torch.set_num_threads` is not free), and
    its time-weighted mean since `mark()`."""

    def __init__(self):
        self.current = torch.get_num_threads()
        self.since, self.weighted = time.perf_counter(), 0.0
        self.marked = self.since

    def set(self, n: int) -> None:
        if n != self.current:
            now = time.perf_counter()
            self.weighted += self.current * (now - self.since)
            self.since = now
            torch.set_num_threads(n)
            self.current = n

    def mark(self) -> None:
        self.marked = self.since = time.perf_counter()
        self.weighted = 0.0

    def mean(self) -> float:
        """The mean thread count since `mark()`, weighted by time."""
        now = time.perf_counter()
        span = now - self.marked
        return (self.weighted + self.current * (now - self.since)) / span if span > 0 else float(self.current)


def follow_workers(layers, cores: Cores, threads: Threads) -> list:
    """Hooks on each decoder layer (forward, and backward through its output) that set the trainer's thread
    count from `cores.trainer_now()`. Returns the handles; an asynchronous CPU run installs them, a
    synchronous or fixed one has nothing to follow."""

    def pace(*_):
        threads.set(cores.trainer_now())

    def on_output(_module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(pace)  # the gradient reaches this layer: its backward comes next

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(pace))
        handles.append(layer.register_forward_hook(on_output))
    return handles
