"""Multi-turn: the arithmetic task with retries. A wrong answer gets "Wrong, try again." and another attempt,
up to `attempts`; a right one scores `discount ** (attempt - 1)`. The cheapest test of the loss masks: the
feedback turns must never be trained on."""
import re
from dataclasses import dataclass

from envs import Step
from registry import require
from tasks import Task, arithmetic


@dataclass
class Config(arithmetic.Config):
    name: str = "arith_retry"
    attempts: int = 3  # answers allowed per episode (env.max_turns caps it too)
    discount: float = 0.5  # a right answer at attempt n scores discount ** (n - 1)

    def check(self):
        super().check()
        require(self.attempts >= 1, "task.attempts", "must be >= 1", self.attempts)
        require(0 < self.discount <= 1, "task.discount", "must be in (0, 1]", self.discount)


class Env:
    def __init__(self, cfg: Config):
        self.cfg, self.answer, self.attempt = cfg, "", 0

    def reset(self, example) -> list[dict]:
        self.answer, self.attempt = example.answer, 0
        return [{"role": "user", "content": example.question}]

    def step(self, action: str) -> Step:
        self.attempt += 1
        numbers = re.findall(r"-?\d+", action)
        if numbers and numbers[-1] == self.answer:
            return Step(None, self.cfg.discount ** (self.attempt - 1), done=True, info={"success": True})
        if self.attempt >= self.cfg.attempts:
            return Step(None, 0.0, done=True)
        return Step("Wrong, try again. Reply with just the number.",
                    info={} if numbers else {"parse_errors": 1})

    def close(self) -> None:
        pass


def build(cfg: Config, seed: int) -> Task:
    task = arithmetic.build(cfg, seed)
    return Task(reward="", train=task.train, test=task.test, env=lambda: Env(cfg))
