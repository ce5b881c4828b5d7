"""Embedded synthetic task: "What is a + b?" for one-digit a and b, scored on the reply's last number.

SmolLM2-135M answers it right about 30% of the time at temperature 1 (the right number is often there, buried
in chatter), so RL has room to climb. Operand tuples are split by the seed into train and test. `terms` and
`op` make it harder, the same prompt with more operands or with products: with `task.terms=3
task.max_operand=5 task.test_size=64 train.lr=1e-5` the untrained model's greedy test pass@1 is 0.27, and the
default rule moves the reward from about 0.1 to about 0.5 over 30 steps (docs/benchmarks.md, "Off-policy
trade-offs"; at the default train.lr it rose for ten steps and fell back).
"""
import itertools
import math
import random
from dataclasses import dataclass

from registry import require
from tasks import Example, Task

OPS = {"+": sum, "*": math.prod}
MAX_TUPLES = 100_000  # operand tuples a task may enumerate


@dataclass
class Config:
    name: str = "arithmetic"
    max_operand: int = 9  # operands drawn from 0..max_operand
    terms: int = 2  # operands in each question
    op: str = "+"  # + (sums) or * (products)
    test_size: int = 20  # operand tuples held out for the test split
    # the verifier: a registered name or "package.module:function" (ablations, tests)
    reward: str = "arithmetic"

    def check(self):
        require(self.max_operand >= 1, "task.max_operand", "must be >= 1", self.max_operand)
        require(self.terms >= 2, "task.terms", "must be >= 2", self.terms)
        require(self.op in OPS, "task.op", f"must be one of {', '.join(OPS)}", self.op)
        tuples = (self.max_operand + 1) ** self.terms
        require(tuples <= MAX_TUPLES, "task.terms",
                f"with task.max_operand={self.max_operand} makes {tuples} questions, over {MAX_TUPLES}",
                self.terms)
        require(0 <= self.test_size < tuples, "task.test_size", f"must be in [0, {tuples})", self.test_size)


def build(cfg: Config, seed: int) -> Task:
    tuples = list(itertools.product(range(cfg.max_operand + 1), repeat=cfg.terms))
    random.Random(seed).shuffle(tuples)
    examples = [Example(f"What is {f' {cfg.op} '.join(map(str, t))}? Reply with just the number.",
                        str(OPS[cfg.op](t))) for t in tuples]
    return Task(reward=cfg.reward, train=examples[cfg.test_size:], test=examples[:cfg.test_size])
