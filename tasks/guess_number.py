"""Multi-turn: guess a secret number in 1..N with "too high" / "too low" after each guess.

The worked example of an environment (docs/design.md, "Adding an environment"): one file, a `Config`, a
`build(cfg, seed) -> Task` whose `env` makes one `Env` per episode, and the `Env`: `reset` gives the first
messages (the same for every episode of an example, so a group shares its prompt), `step` reads the policy's
turn as text and answers. A hit scores 1 minus `turn_cost` per earlier guess; a miss after the last turn
scores 0. Random distinct guesses hit about 37% of the time in 6 tries over 1..16; binary search always
within 5.
"""
import random
import re
from dataclasses import dataclass

from envs import Step
from registry import require
from tasks import Example, Task


@dataclass
class Config:
    name: str = "guess_number"
    high: int = 16  # the secret lies in 1..high
    turn_cost: float = 0.1  # reward lost per guess before the hit
    copies: int = 8  # training examples per secret (the prompts are the same; the data order differs)

    def check(self):
        require(self.high >= 2, "task.high", "must be >= 2", self.high)
        require(0 <= self.turn_cost < 1, "task.turn_cost", "must be in [0, 1)", self.turn_cost)
        require(self.copies >= 1, "task.copies", "must be >= 1", self.copies)


class Env:
    def __init__(self, cfg: Config):
        self.cfg, self.secret, self.guesses = cfg, 0, []

    def reset(self, example: Example) -> list[dict]:
        self.secret, self.guesses = int(example.answer), []
        return [{"role": "user", "content": example.question}]

    def step(self, action: str) -> Step:
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            return Step(f"Reply with one number between 1 and {self.cfg.high}.", info={"parse_errors": 1})
        guess = int(numbers[-1])
        self.guesses.append(guess)
        if guess == self.secret:
            reward = max(0.0, 1.0 - self.cfg.turn_cost * (len(self.guesses) - 1))
            return Step(None, reward, done=True, info={"success": True})
        return Step("Too high. Guess again." if guess > self.secret else "Too low. Guess again.")

    def close(self) -> None:
        pass


def build(cfg: Config, seed: int) -> Task:
    question = (f"I am thinking of a number between 1 and {cfg.high}. Guess it. After each guess I will say "
                "if it is too high or too low. Reply with just the number.")
    secrets = list(range(1, cfg.high + 1))
    train = [Example(question, str(s)) for s in secrets for _ in range(cfg.copies)]
    random.Random(seed).shuffle(train)
    return Task(reward="", train=train, test=[Example(question, str(s)) for s in secrets],
                env=lambda: Env(cfg))
