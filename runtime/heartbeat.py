"""Heartbeats: every rollout worker and trainer rank says, in shared memory, when it last made progress and
what it is doing, so that the launcher can tell a slow process from a stuck one (launch/supervisor.py).

    hearts = Heartbeats(["rollout-0", "trainer-0"])     # the launcher, before spawning
    heart = hearts.of("rollout-0")                       # in the process
    heart.beat("generate")                               # every decode step: about a microsecond
    hearts.stuck(Allowance(300, 1800, 1800))           # the launcher, every second: [(name, phase, age)]

A process that waits (at the gate, for data, for rank 0) beats inside its wait loop, so waiting is not being
stuck. Start-up (imports, a model to load) is allowed `start_s` before the first beat, SLOW_PHASES
(evaluation, a checkpoint, the first training step, which may compile) `slow_s` between beats, and every other
phase `hang_s`.
"""
import time
from typing import NamedTuple

import torch

PHASES = ("start", "generate", "load_weights", "wait_gate", "env_wait", "score", "ring_put", "wait_data",
          "first_step", "train_step", "publish", "evaluate", "checkpoint", "wait_rank0", "collective", "done")
SLOW_PHASES = frozenset(("evaluate", "checkpoint", "first_step"))


class Allowance(NamedTuple):
    """Seconds a process may go without a beat: in most phases, in SLOW_PHASES, and at start-up."""
    hang_s: float
    slow_s: float
    start_s: float

    def of(self, phase: str) -> float:
        return self.start_s if phase == "start" else self.slow_s if phase in SLOW_PHASES else self.hang_s
# columns: monotonic time of the last beat, phase index, step posted (trainers)
_WHEN, _PHASE, _STEP = 0, 1, 2


class Heartbeats:
    def __init__(self, names: list[str]):
        self.names = list(names)
        self._table = torch.zeros(len(self.names), 3, dtype=torch.float64).share_memory_()
        self._rows = None  # a numpy view of the shared table, made in each process (writes cost ~100 ns)

    def __getstate__(self):
        return {"names": self.names, "_table": self._table, "_rows": None}

    def rows(self):
        if self._rows is None:
            self._rows = self._table.numpy()
        return self._rows

    def of(self, name: str) -> "Heart":
        return Heart(self, self.names.index(name))

    def restart(self, name: str) -> None:
        """The launcher (re)starts `name`: its clock starts now, in `start`."""
        self.of(name).beat("start")

    def phase(self, name: str) -> str:
        return PHASES[int(self.rows()[self.names.index(name), _PHASE])]

    def step(self, name: str) -> int:
        return int(self.rows()[self.names.index(name), _STEP])

    def stuck(self, allowance: Allowance, now: float | None = None) -> list[tuple]:
        """(name, phase, seconds since its last beat) of every process past its phase's allowance."""
        now = time.monotonic() if now is None else now
        out = []
        for name, (when, phase, _) in zip(self.names, self.rows().tolist()):
            phase = PHASES[int(phase)]
            if phase != "done" and now - when > allowance.of(phase):
                out.append((name, phase, now - when))
        return out


class NoHeart:
    """Where nobody watches (unit tests of one component): beats go nowhere."""

    def beat(self, phase: str) -> None:
        pass

    def post_step(self, step: int) -> None:
        pass


class Heart:
    """One process's row."""

    def __init__(self, hearts: Heartbeats, row: int):
        self.hearts, self.row = hearts, row

    def beat(self, phase: str) -> None:
        rows = self.hearts.rows()
        rows[self.row, _PHASE] = PHASES.index(phase)
        rows[self.row, _WHEN] = time.monotonic()

    def post_step(self, step: int) -> None:
        """Trainer rank 0: about to broadcast `step`'s batch (the other ranks wait for this, beating)."""
        self.hearts.rows()[self.row, _STEP] = step
