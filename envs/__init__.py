"""Multi-turn episodes: the environment protocol, and what the rollout worker needs to drive one.

An environment sees text only; the rollout worker owns tokens and turns (envs/episode.py):

    env = task.env()                      # one per episode, built in the rollout process
    messages = env.reset(example)         # deterministic per example: a group's K episodes share their prompt
    step = env.step(action_text)          # the policy's turn, decoded
                                            -> Step(observation | None, reward, done, info)
    env.close()

An episode's reward is the sum of its steps' rewards. `info` may count what happened in the step, under the
keys of `COUNTED` (a tool call, its error, ...): the worker adds them to its counters (`episode/<key>`
metrics).
A one-shot task is the one-turn special case: no environment, its reply scored by the task's reward.

Files: `episode.py` (one episode's record and the turns of a group), `render.py` (observations as tokens, from
a fixed rendering of the chat template), `pool.py` (environment steps beside the engine, with timeouts),
`tools.py` (the calculator and the sandboxed python tool, and the two call formats). The environments
themselves are tasks: `tasks/guess_number.py` is the worked example.
"""
from dataclasses import dataclass, field
from typing import Protocol

# What a step's `info` may count (each an int), logged as episode/<key> summed over the run.
COUNTED = ("tool_calls", "tool_errors", "tool_timeouts", "parse_errors", "unknown_tools")


@dataclass
class Step:
    observation: str | None  # the environment's answer, the next user (or tool) turn; None when done
    reward: float = 0.0
    done: bool = False
    # counts under COUNTED's keys; "success": bool for the success rate
    info: dict = field(default_factory=dict)


class Env(Protocol):
    def reset(self, example) -> list[dict]:
        """The first messages ({"role", "content"}) of the episode for `example` (a tasks.Example)."""
        ...

    def step(self, action: str) -> Step:
        """The policy's turn as text -> what the environment answers."""
        ...

    def close(self) -> None: ...
