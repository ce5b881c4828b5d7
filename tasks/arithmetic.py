"""Embedded synthetic task: "What is a + b?" for one-digit a and b, scored on the reply's last number.

SmolLM2-135M answers it right about 30% of the time at temperature 1 (the right number is often there,
buried in chatter), so RL has room to climb. Pairs (a, b) are split by the seed into train and test.
"""
import random
from dataclasses import dataclass

from registry import require
from tasks import Example, Task


@dataclass
class Config:
    name: str = "arithmetic"
    max_operand: int = 9  # operands drawn from 0..max_operand
    test_size: int = 20  # (a, b) pairs held out for the test split
    # the verifier: a registered name or "package.module:function" (ablations, tests)
    reward: str = "arithmetic"

    def check(self):
        pairs = (self.max_operand + 1) ** 2
        require(self.max_operand >= 1, "task.max_operand", "must be >= 1", self.max_operand)
        require(0 <= self.test_size < pairs, "task.test_size", f"must be in [0, {pairs})", self.test_size)


def build(cfg: Config, seed: int) -> Task:
    pairs = [(a, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    examples = [Example(f"What is {a} + {b}? Reply with just the number.", str(a + b)) for a, b in pairs]
    return Task(reward=cfg.reward, train=examples[cfg.test_size:], test=examples[:cfg.test_size])
