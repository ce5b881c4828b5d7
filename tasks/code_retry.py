"""Programming problems with test feedback between attempts: task=code's data and sandbox, as episodes.

Each turn's last ```python block runs against the problem's cases in the sandbox (rewards/code.py, from inside
the environment step, so a slow or hostile program never stalls generation). All passing ends the episode with
`task.discount ** (attempt - 1)`; otherwise the model is told how many cases passed and tries again, up to
`task.attempts`. For GPU users: runnable on the CPU, not expected to learn there with the 135M model.
"""
from dataclasses import dataclass

from envs import Step
from registry import require
from rewards.code import CodeReward, extract_program
from tasks import Task, code


@dataclass
class Config(code.Config):
    name: str = "code_retry"
    attempts: int = 3  # programs allowed per episode (env.max_turns caps it too)
    discount: float = 0.5  # passing at attempt n scores discount ** (n - 1)

    def check(self):
        super().check()
        require(self.attempts >= 1, "task.attempts", "must be >= 1", self.attempts)
        require(0 < self.discount <= 1, "task.discount", "must be in (0, 1]", self.discount)

    @property
    def min_reward_timeout_s(self) -> float:
        """No reward pool here: the environment step runs the sandbox (env.step_timeout_s bounds it)."""
        return 0.0

    def reward_options(self) -> dict:
        options = super().reward_options()
        for key in ("attempts", "discount"):
            del options[key]
        return dict(options, mode="fraction")  # the share passed is the feedback; the reward needs them all


class Env:
    def __init__(self, cfg: Config, tests: CodeReward):
        self.cfg, self.tests, self.reference, self.attempt = cfg, tests, "", 0

    def reset(self, example) -> list[dict]:
        self.reference, self.attempt = example.answer, 0
        return [{"role": "user", "content": example.question}]

    def step(self, action: str) -> Step:
        self.attempt += 1
        if extract_program(action) is None:
            passed, feedback = 0.0, "No ```python code block found."
        else:
            passed = self.tests(action, self.reference)
            feedback = f"{round(100 * passed)}% of the tests passed."
        if passed >= 1.0:
            return Step(None, self.cfg.discount ** (self.attempt - 1), done=True, info={"success": True})
        if self.attempt >= self.cfg.attempts:
            return Step(None, 0.0, done=True)
        return Step(f"{feedback} Fix the program and answer with the whole program again.")

    def close(self) -> None:
        pass


def build(cfg: Config, seed: int) -> Task:
    data = code.build(cfg, seed)  # checks the sandbox first
    tests = CodeReward(**cfg.reward_options())
    return Task(reward="", train=data.train, test=data.test, env=lambda: Env(cfg, tests))
